"""INT4 pack-quantized (compressed-tensors `pack-quantized`, Kimi K2-Thinking's routed experts: int32
`weight_packed` of 8 codes, float `weight_scale` per 32 inputs, `weight_shape`). The codec is formats/int4.py
(through formats/compressed_tensors.py); experts are kept as their codes and scales (KeptBytesFormat). Dense
method `INT4_KEPT` (weights.codes_linear: `--dense-weights int4`, `quantize --dense int4`): a Linear keeps
`weight_packed`, `weight_scale` and `weight_shape` (checked at load), decode-sized inputs run
csrc/quant.c's INT4 product, prefill-sized ones GEMMs on row chunks decoded by csrc/quant.c's int4_decode.
"""

from __future__ import annotations

import torch

from moeswap.formats import compressed_tensors as ct
from moeswap.formats import int4
from moeswap.formats.checkpoint import CheckpointError
from moeswap.ops import cpu_kernels
from moeswap.ops.expert import Int4ExpertWeights
from moeswap.weights.codes_linear import CodesLinear
from moeswap.weights.dense import LinearMethod
from moeswap.weights.format import PROJS, expect, first_true
from moeswap.weights.kept_bytes import KeptBytesFormat


class Int4KeptLinear(CodesLinear):
    name, kernel, stored = "int4_kept", "int4", "int4"
    parts = ("weight_packed", "weight_scale", "weight_shape")  # the checkpoint's names, weight_shape included
    codes = ("weight_packed", "weight_scale")
    dtypes = {"weight_packed": torch.int32, "weight_scale": torch.bfloat16}  # csrc/quant.c's INT4

    def decode_rows(self, layer, start, stop, dtype):
        packed, scale = layer.weight_packed[start:stop], layer.weight_scale[start:stop]
        if (dtype == torch.float32 and packed.is_cpu and packed.dtype == torch.int32 and scale.dtype == torch.bfloat16
                and layer.in_features % 32 == 0 and packed.is_contiguous() and scale.is_contiguous()):
            kernel = cpu_kernels.kernel()
            if kernel is not None:  # the same values in one pass instead of torch's eight (prefill: every chunk)
                return kernel.int4_decode(packed, scale)
        return int4.decode(packed, scale, (stop - start, layer.in_features), dtype)

    def run_kernel(self, kernel, layer, x_TI):
        return kernel.quant_linear("int4", x_TI, layer.weight_packed, layer.weight_scale)

    def sources(self, layer):
        return layer.weight_packed, layer.weight_scale


INT4_KEPT = Int4KeptLinear()


class Int4Format(KeptBytesFormat):
    """compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking's routed experts: `weight_packed` int32,
    bf16 `weight_scale` per 32 inputs, `weight_shape`); the bf16 products compressed-tensors forms are the
    weights (formats/int4.py). Kept as Int4ExpertWeights (the codes and scales; weight_shape is checked at
    load and not kept)."""

    name, label, ct_format = "int4", "INT4", ct.FORMATS["int4"]
    suffixes = frozenset({"weight_packed", "weight_scale", "weight_shape"})
    main = "weight_packed"
    kept_form, scale_suffix = Int4ExpertWeights, "weight_scale"
    linear_method: LinearMethod | None = INT4_KEPT

    def _kept(self, parts):
        return Int4ExpertWeights.unchecked(**{k: (v.view(torch.int32) if k.endswith("_packed") and v.dtype == torch.uint8
                                                  else v) for k, v in parts.items() if not k.endswith("_shape")})

    def _check_kept(self, w, names):
        # codes are finite: a weight is not when its scale is not, or when code * scale overflows the scale's dtype
        for proj in PROJS:
            scale = getattr(w, f"{proj}_scale")
            bad = ~(scale.float() * -8).to(scale.dtype).isfinite()
            if bool(bad.any()):
                return (names[proj]["weight_scale"], proj, f"decodes to non-finite weights (NaN or Inf), first at "
                        f"scale {first_true(bad)}; expected finite scales")
        return None

    def dtypes_fit(self, dtypes):
        return dtypes["weight_packed"] == torch.int32

    def check_dtypes(self, dtypes, where):
        if not dtypes["weight_scale"].is_floating_point:
            raise CheckpointError(f"{where}: INT4 weight_scale must be a float tensor, found {dtypes['weight_scale']}")

    def check_expert_tensors(self, ckpt, names, shape, where):
        expect(ckpt.info(names["weight_packed"]), int4.packed_shape(shape), torch.int32, where)
        scale = ckpt.info(names["weight_scale"])
        expect(scale, int4.scale_shape(shape), None, where)
        self.check_dtypes({"weight_scale": scale.dtype}, f"{scale.name} in {scale.file.name} ({where})")
        expect(ckpt.info(names["weight_shape"]), (2,), torch.int32, where)

    def logical_shape(self, infos):
        return infos["weight_packed"].shape[0], infos["weight_scale"].shape[1] * int4.GROUP

    def check_stored(self, stored, block=None):
        # the checks decoding makes, on one row (a dense weight kept as stored is not decoded whole at load)
        packed, scale = stored["weight_packed"], stored["weight_scale"]
        if packed.ndim != 2 or scale.ndim != 2 or packed.shape[0] != scale.shape[0]:
            raise ValueError(f"INT4 weight_packed {list(packed.shape)} and weight_scale {list(scale.shape)} must be "
                             f"[out, in/8] and [out, in/32]")
        int4.decode(packed[:1], scale[:1], (min(1, packed.shape[0]), scale.shape[1] * int4.GROUP))
        shape = [packed.shape[0], scale.shape[1] * int4.GROUP]
        if stored["weight_shape"].tolist() != shape:
            raise ValueError(f"INT4 weight_shape {stored['weight_shape'].tolist()} does not match the {shape} its "
                             f"weight_packed and weight_scale hold")

    def decode(self, stored, dtype, block=None):
        return ct.decode_weight("int4", stored, dtype)

    def stored_specs(self, shape):
        return ct.stored_specs(self.name, shape)

    def encode(self, w, mode="even"):
        return ct.encode_weight(self.name, w, mode)


INT4 = Int4Format()
