"""Bytes <-> tensors: safetensors checkpoints (read and streamed write) and weight codecs.

Knows nothing about models or layer names; callers pass tensor names and raw bytes. Entry points:
`checkpoint.Checkpoint.open(path)`, `writer.write_shard`, the pure codecs `mxfp4`, `mxfp8`, `fp8_block`,
`int4` (shared MX scale logic in `mx`) and `compressed_tensors` (quantization_config and per-module tensors).
The format objects built on them live in moeswap.weights.
"""
