"""Bytes <-> tensors: safetensors checkpoints and weight codecs (MXFP4, ...).

Knows nothing about models or layer names; callers pass tensor names and raw bytes.
Entry points: `checkpoint.Checkpoint.open(path)` and the pure functions in `mxfp4`.
"""
