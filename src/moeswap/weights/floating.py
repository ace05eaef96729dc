"""The float format: a bf16/fp16/fp32 `weight`, and the kept form of every decoded expert (ops.expert's
ExpertWeights, computed by ops.linear: bf16 weights may stay bf16 under fp32 math on the CPU). Its dense
method `BF16_STORED` keeps a bf16 Linear weight so (csrc/linear_bf16.c for decode-sized inputs, fp32 sums,
the values of an fp32 copy at half the bytes); plain float Linears are dense.FLOAT_LINEAR.
"""

from __future__ import annotations

import torch

from moeswap.formats.checkpoint import CheckpointError
from moeswap.ops import cpu_kernels
from moeswap.ops.activation import glu
from moeswap.ops.expert import ExpertWeights
from moeswap.ops.linear import linear
from moeswap.weights.dense import LinearMethod
from moeswap.weights.format import DENSE_FIELDS, FP8_DTYPES, ROW_CHUNK_BYTES, WeightFormat, expect, placed


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


class FloatFormat(WeightFormat):
    name, label = "float", "float"
    suffixes = frozenset({"weight"})
    kept_form: type | None = ExpertWeights  # every decoded expert computes as FLOAT
    linear_method: LinearMethod | None = BF16_STORED

    def dtypes_fit(self, dtypes):
        return dtypes["weight"].is_floating_point and dtypes["weight"] not in FP8_DTYPES

    def check_expert_tensors(self, ckpt, names, shape, where):
        info = ckpt.info(names["weight"])
        expect(info, shape, None, where)
        if not info.dtype.is_floating_point:
            raise CheckpointError(f"{info.name} in {info.file.name}: expected a float tensor, found {info.dtype}")
        if info.dtype.itemsize == 1:
            raise CheckpointError(f"{info.name} in {info.file.name} ({where}): float8 weight without a "
                                  f"weight_scale: expected bf16/fp16/fp32, or MXFP8 weight + weight_scale")

    def decode(self, stored, dtype, block=None):
        return stored["weight"].to(dtype)

    # the kept form of every decoded expert (ops.expert.ExpertWeights)

    def forward(self, w, x_TI, act, situ_betas):
        # ops.linear: weights may be bf16 under fp32 math (kept as stored on the CPU)
        h_TF = glu(act, linear(x_TI, w.w1_FI), linear(x_TI, w.w3_FI), situ_betas)
        return linear(h_TF, w.w2_IF)

    def weight(self, w, proj, dtype):
        return getattr(w, DENSE_FIELDS[proj]).to(dtype)

    def shape(self, w, proj):
        return tuple(getattr(w, DENSE_FIELDS[proj]).shape)

    def project_forward(self, w, proj, x):
        return linear(x, getattr(w, DENSE_FIELDS[proj]))

    def project_backward(self, w, proj, dy):
        W = getattr(w, DENSE_FIELDS[proj])
        if W.dtype == dy.dtype:
            return dy @ W
        dy_PO = dy.reshape(-1, W.shape[0])
        dx = torch.zeros(dy_PO.shape[0], W.shape[1], dtype=dy.dtype, device=dy.device)
        rows = max(1, ROW_CHUNK_BYTES // (W.shape[1] * dy.element_size()))
        for r in range(0, W.shape[0], rows):  # widen a chunk of rows at a time
            dx.addmm_(dy_PO[:, r : r + rows], W[r : r + rows].to(dy.dtype))
        return dx.reshape(*dy.shape[:-1], W.shape[1])

    def convert(self, w, decoded, dtype, device, pin=False):
        return placed(ExpertWeights(*(t.to(dtype) for t in (w.w1_FI, w.w3_FI, w.w2_IF))), device, pin)


FLOAT = FloatFormat()
