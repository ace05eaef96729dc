"""Block FP8 (DeepSeek-V3, Kimi K2: float8_e4m3fn `weight` + fp32 `weight_scale_inv` per 128 x 128 block;
codec formats/fp8_block.py). Routed experts are kept as their codes (KeptBytesFormat). Dense method
`FP8_BLOCK_KEPT`: a Linear keeps the published codes and scales under their own names;
decode-sized fp32 CPU inputs multiply from the codes (csrc/quant.c: code * scale in registers, one byte read
per weight), other inputs (prefill, autograd, compiling) by the decoded weight (formats/fp8_block.decode,
the same values), made per call and not kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeswap.formats import fp8_block
from moeswap.formats.checkpoint import CheckpointError
from moeswap.ops import cpu_kernels
from moeswap.ops.expert import FP8ExpertWeights
from moeswap.ops.linear import KERNEL_MAX_ROWS
from moeswap.weights.dense import LinearMethod
from moeswap.weights.format import PROJS, expect, first_true
from moeswap.weights.kept_bytes import KeptBytesFormat


class FP8BlockKeptLinear(LinearMethod):
    name, kernel = "fp8_block", "fp8"
    weight_is_values = False
    codes, code_rows = ("weight", "weight_scale_inv"), fp8_block.BLOCK[0]

    def keeps(self, stored, dtypes, block, compute, device):
        """csrc/quant.c's blocks are 128 x 128 E4M3 codes, its math fp32, on the CPU (another float8,
        e5m2, is decoded at load)."""
        return (stored == "fp8_block" and dtypes["weight"] == torch.float8_e4m3fn
                and tuple(block or ()) == fp8_block.BLOCK and compute == torch.float32
                and torch.device(device).type == "cpu" and cpu_kernels.kernel() is not None)

    def load_weights(self, layer, tensors, device):
        super().load_weights(layer, {"weight": tensors["weight"], "weight_scale_inv": tensors["weight_scale_inv"].float()},
                             device)

    def apply(self, layer, x):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        kernel = (cpu_kernels.for_inference(x) if 0 < rows <= KERNEL_MAX_ROWS and x.dtype == torch.float32
                  and x.shape[-1] % 32 == 0 else None)
        if kernel is not None:
            y = kernel.quant_linear("fp8", x.reshape(rows, x.shape[-1]).contiguous(), layer.weight,
                                    layer.weight_scale_inv)
            return y.view(*x.shape[:-1], layer.out_features)
        return F.linear(x, self.values(layer, x.dtype))

    def values(self, layer, dtype: torch.dtype = torch.float32):
        """The decoded weight [out, in] in `dtype` (products in fp32)."""
        return fp8_block.decode(layer.weight, layer.weight_scale_inv, fp8_block.BLOCK, dtype)

    def sources(self, layer):
        return layer.weight, layer.weight_scale_inv


FP8_BLOCK_KEPT = FP8BlockKeptLinear()


class FP8BlockFormat(KeptBytesFormat):
    """DeepSeek block FP8: dense modules (kept by FP8_BLOCK_KEPT, or decoded at load) and routed experts,
    kept as FP8ExpertWeights (the codes, and the scales as fp32: exact from bf16 or fp16)."""

    name, label = "fp8_block", "block FP8"
    suffixes = frozenset({"weight", "weight_scale_inv"})
    kept_form, scale_suffix = FP8ExpertWeights, "weight_scale_inv"
    linear_method = FP8_BLOCK_KEPT

    def _kept(self, parts):
        return FP8ExpertWeights.unchecked(**{
            k: (v.view(torch.float8_e4m3fn) if v.dtype == torch.uint8 else v) if k.endswith("_weight")
            else v.to(torch.float32) for k, v in parts.items()})

    def _check_kept(self, w, names):
        # a weight is NaN for a NaN code (S.1111.111) or scale, infinite for an infinite scale or a product past
        # fp32's range (a scale above 3.4e38 / 448)
        for proj in PROJS:
            codes = getattr(w, f"{proj}_weight").view(torch.uint8)
            nan = (codes | 0x80) == 0xFF
            if bool(nan.any()):
                return (names[proj]["weight"], proj, f"holds NaN codes (E4M3 S.1111.111), first at "
                        f"{first_true(nan)}; expected finite weights")
            scale = getattr(w, f"{proj}_scale_inv")
            bad = ~(scale * fp8_block.E4M3_MAX).isfinite()
            if bool(bad.any()):
                return (names[proj]["weight_scale_inv"], proj, f"decodes to non-finite weights (NaN or Inf), "
                        f"first at block {first_true(bad)}; expected finite scales below 3.4e38 / 448")
        return None

    def dtypes_fit(self, dtypes):
        return True  # fp8_block.decode names a wrong dtype

    def check_declared(self, where, declared, fp8_block_size=None):
        if fp8_block_size is None:
            raise CheckpointError(f"{where}: has weight_scale_inv (block FP8) but config.json has no "
                                  f"quant_method 'fp8' quantization_config with weight_block_size")

    def check_expert_tensors(self, ckpt, names, shape, where):
        info = ckpt.info(names["weight"])
        expect(info, shape, torch.float8_e4m3fn, where)
        scale = ckpt.info(names["weight_scale_inv"])
        expect(scale, fp8_block.scale_shape(shape), None, where)
        if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(f"{scale.name} in {scale.file.name} ({where}): weight_scale_inv must be a float "
                                  f"tensor, found {scale.dtype}")

    def check_stored(self, stored, block=None):
        fp8_block.check(stored["weight"], stored["weight_scale_inv"], block)

    def decode(self, stored, dtype, block=None):
        return fp8_block.decode(stored["weight"], stored["weight_scale_inv"], block or fp8_block.BLOCK, dtype)

    def stored_specs(self, shape):
        return {"weight": (torch.float8_e4m3fn, tuple(shape)),
                "weight_scale_inv": (torch.float32, fp8_block.scale_shape(tuple(shape)))}

    def encode(self, w, mode="even"):
        q, scale_inv = fp8_block.encode(w)
        return {"weight": q, "weight_scale_inv": scale_inv}


FP8_BLOCK = FP8BlockFormat()
