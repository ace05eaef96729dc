"""Block FP8 (DeepSeek-V3, Kimi K2: float8_e4m3fn `weight` + fp32 `weight_scale_inv` per 128 x 128 block).
Dense method `FP8_BLOCK_KEPT`: a Linear keeps the published codes and scales under their own names;
decode-sized fp32 CPU inputs multiply from the codes (csrc/quant.c: code * scale in registers, one byte read
per weight), other inputs (prefill, autograd, compiling) by the decoded weight (formats/fp8_block.decode,
the same values), made per call and not kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeswap.formats import fp8_block
from moeswap.ops import cpu_kernels
from moeswap.ops.linear import KERNEL_MAX_ROWS
from moeswap.weights.dense import LinearMethod


class FP8BlockKeptLinear(LinearMethod):
    name, kernel = "fp8_block", "fp8"
    weight_is_values = False

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

    def with_values(self, layer):
        plain = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
        plain.weight = nn.Parameter(self.values(layer), requires_grad=False)
        return plain


FP8_BLOCK_KEPT = FP8BlockKeptLinear()
