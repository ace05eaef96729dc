"""MXFP8 (compressed-tensors `mxfp8-quantized`: float8 `weight` + E8M0 `weight_scale` bytes per 32), and
`MXFormat`, what the compressed-tensors MX formats share (MXFP4 builds on it). Experts are decoded at read
and kept as FLOAT; the codec is formats/mxfp8.py.
"""

from __future__ import annotations

import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import mxfp8
from moeswap.formats.checkpoint import CheckpointError
from moeswap.weights.dense import LinearMethod
from moeswap.weights.floating import FloatFormat
from moeswap.weights.format import FP8_DTYPES, SCALE_DTYPES, expect


class MXFormat(FloatFormat):
    """The compressed-tensors MX formats: E8M0 scale bytes per 32 weights, declared in config.json."""

    linear_method: LinearMethod | None = None  # dense MX weights are decoded at load

    def check_dtypes(self, dtypes, where):
        if dtypes["weight_scale"] not in SCALE_DTYPES:
            raise CheckpointError(f"{where}: weight_scale must be uint8 E8M0 bytes, found {dtypes['weight_scale']}")

    def _check_scale(self, ckpt, names, shape, where) -> None:
        expect(ckpt.info(names["weight_scale"]), (shape[0], shape[1] // 32), torch.uint8, where)

    def stored_specs(self, shape):
        return ct.stored_specs(self.name, shape)

    def encode(self, w, mode="even"):
        return ct.encode_weight(self.name, w, mode)


class MXFP8Format(MXFormat):
    """Read and decoded to float (kept as FLOAT experts)."""

    name, label, ct_format = "mxfp8", "MXFP8", ct.FORMATS["mxfp8"]
    suffixes = frozenset({"weight", "weight_scale"})
    kept_form = None  # decoded at read: its experts compute as FLOAT

    def dtypes_fit(self, dtypes):
        return dtypes["weight"] in FP8_DTYPES

    def check_expert_tensors(self, ckpt, names, shape, where):
        info = ckpt.info(names["weight"])
        expect(info, shape, None, where)
        if info.dtype not in FP8_DTYPES:
            raise CheckpointError(f"{info.name} in {info.file.name} ({where}): MXFP8 weight must be float8_e4m3fn "
                                  f"or float8_e5m2, found {info.dtype}")
        self._check_scale(ckpt, names, shape, where)

    def decode(self, stored, dtype, block=None):
        # exact in fp32, then cast: the same bits as decoding straight to `dtype`
        return mxfp8.decode(stored["weight"], stored["weight_scale"], torch.float32).to(dtype)


MXFP8 = MXFP8Format()
