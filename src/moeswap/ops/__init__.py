"""Kernels behind names. Each op has a readable plain-torch reference and a parity test;
faster variants (compiled, CUDA, C) register here and are chosen by `select`."""
