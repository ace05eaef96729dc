"""INT8 channel weights (compressed-tensors `int-quantized`, strategy channel: int8 `weight` [out, in] + fp32
`weight_scale` [out, 1]; codec formats/int8.py): moeswap's `--dense-weights int8` and `quantize --dense int8`.
Dense method `INT8_KEPT` (weights.codes_linear): a Linear keeps its codes and scales, decode-sized inputs run
csrc/int8.c. Routed experts in this format are decoded at read (kept as FLOAT). Its suffixes are MXFP8's: the
weight's dtype (int8, not float8) tells them apart (registry.for_suffixes).
"""

from __future__ import annotations

import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import int8
from moeswap.formats.checkpoint import CheckpointError
from moeswap.weights.codes_linear import CodesLinear
from moeswap.weights.dense import LinearMethod
from moeswap.weights.floating import FloatFormat
from moeswap.weights.format import expect


class Int8KeptLinear(CodesLinear):
    name, kernel, stored = "int8_kept", "int8", "int8"
    parts = codes = ("weight", "weight_scale")
    dtypes = {"weight": torch.int8, "weight_scale": int8.SCALE_DTYPE}

    def decode_rows(self, layer, start, stop, dtype):
        return int8.decode(layer.weight[start:stop], layer.weight_scale[start:stop], dtype)

    def run_kernel(self, kernel, layer, x_TI):
        return kernel.int8_linear(x_TI, layer.weight, layer.weight_scale)


INT8_KEPT = Int8KeptLinear()


class Int8Format(FloatFormat):
    """compressed-tensors int-quantized, channel strategy (the codes int8, one fp32 scale per output row)."""

    name, label, ct_format = "int8", "INT8", ct.FORMATS["int8"]
    suffixes = frozenset({"weight", "weight_scale"})
    kept_form = None  # decoded at read: its experts compute as FLOAT
    linear_method: LinearMethod | None = INT8_KEPT

    def dtypes_fit(self, dtypes):
        return dtypes["weight"] == torch.int8

    def check_dtypes(self, dtypes, where):
        if not dtypes["weight_scale"].is_floating_point:
            raise CheckpointError(f"{where}: INT8 weight_scale must be a float tensor, found {dtypes['weight_scale']}")

    def check_expert_tensors(self, ckpt, names, shape, where):
        expect(ckpt.info(names["weight"]), shape, torch.int8, where)
        scale = ckpt.info(names["weight_scale"])
        expect(scale, int8.scale_shape(shape), None, where)
        self.check_dtypes({"weight_scale": scale.dtype}, f"{scale.name} in {scale.file.name} ({where})")

    def check_stored(self, stored, block=None):
        int8.check(stored["weight"], stored["weight_scale"])

    def decode(self, stored, dtype, block=None):
        return int8.decode(stored["weight"], stored["weight_scale"], dtype)

    def stored_specs(self, shape):
        return ct.stored_specs(self.name, shape)

    def encode(self, w, mode="even"):
        return ct.encode_weight(self.name, w, mode)


INT8 = Int8Format()
