"""The float format: a bf16/fp16/fp32 `weight`. Its dense method `BF16_STORED` keeps a bf16 weight as stored
under fp32 math on the CPU (ops.linear.linear: csrc/linear_bf16.c for decode-sized inputs, fp32 sums, the
values of an fp32 copy at half the bytes); plain float Linears are dense.FLOAT_LINEAR.
"""

from __future__ import annotations

import torch

from moeswap.ops import cpu_kernels
from moeswap.ops.linear import linear
from moeswap.weights.dense import LinearMethod


def keeps_bf16(stored: torch.dtype, compute: torch.dtype, device) -> bool:
    """Whether a weight stored as `stored` stays so under `compute` math on `device` at speed: bf16 under fp32
    on a CPU with the kernel (dense Linears, and float routed experts alike)."""
    return (stored == torch.bfloat16 and compute == torch.float32 and torch.device(device).type == "cpu"
            and cpu_kernels.kernel() is not None)


class BF16StoredLinear(LinearMethod):
    """A bias-free Linear whose bf16 `weight` stays bf16 under fp32 math (ops.linear.linear)."""

    name, kernel = "bf16_stored", "bf16"

    def keeps(self, stored, dtypes, block, compute, device):
        return stored == "float" and keeps_bf16(dtypes["weight"], compute, device)

    def apply_values(self, x, weight, bias=None):
        return linear(x, weight)


BF16_STORED = BF16StoredLinear()
