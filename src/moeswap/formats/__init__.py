"""Bytes <-> tensors: safetensors checkpoints (read and streamed write) and weight codecs.

Knows nothing about models or layer names; callers pass tensor names and raw bytes. Entry points:
`checkpoint.Checkpoint.open(path)`, `writer.write_shard`, the pure codecs `mxfp4`, `mxfp8`, `fp8_block`
(shared MX scale logic in `mx`), `compressed_tensors` (quantization_config and per-module tensors) and
`weights` (any stored linear weight as float).
"""
