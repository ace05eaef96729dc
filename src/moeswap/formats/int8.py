"""compressed-tensors `int-quantized` INT8 weights, channel strategy (moeswap's int8 dense weights): symmetric
signed 8-bit integers q in [-127, 127] `weight` int8 [out, in], one fp32 `weight_scale` per output row [out, 1].
W = q * scale, one fp32 product per weight.

Pure functions on tensors; knows nothing of checkpoints or module names.
Entry points: `decode(q, scale)`, `encode(w)`.
"""

from __future__ import annotations

import torch

Q_MAX = 127  # symmetric: -128 is never written, so -q is a code too
SCALE_DTYPE = torch.float32


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return shape[0], 1


def check(q: torch.Tensor, scale: torch.Tensor) -> None:
    """ValueError naming the problem unless (q, scale) is an INT8 channel pair `decode` takes."""
    if q.dtype != torch.int8 or q.ndim != 2:
        raise ValueError(f"INT8 weight must be 2-D int8 [out, in], found {q.dtype} of shape {list(q.shape)}")
    if not scale.is_floating_point() or tuple(scale.shape) != scale_shape(tuple(q.shape)):
        raise ValueError(f"INT8 weight_scale for weight {list(q.shape)} must be a float tensor of shape "
                         f"{list(scale_shape(tuple(q.shape)))} (one per output row), found {scale.dtype} of shape "
                         f"{list(scale.shape)}")


def decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight int8 [out, in] * weight_scale [out, 1] (products in fp32) -> [out, in] in `dtype`."""
    check(q, scale)
    return (q.float() * scale.float()).to(dtype)


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [out, in] -> (weight int8, weight_scale fp32 [out, 1]): per row scale = amax / 127, q = round(w /
    scale) to even, clamped to [-127, 127]. An all-zero row gets scale 1; a row holding NaN or Inf a NaN scale
    (it decodes to NaN)."""
    if not w.is_floating_point() or w.ndim != 2:
        raise ValueError(f"INT8 encode needs a 2-D float tensor, got {w.dtype} of shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(1, keepdim=True) if w.shape[1] else wf.new_zeros(w.shape[0], 1)
    scale = torch.where(amax > 0, amax / Q_MAX, 1.0)
    scale = torch.where(torch.isfinite(wf).all(1, keepdim=True), scale, float("nan"))
    q = (wf / scale).nan_to_num(0.0).round().clamp(-Q_MAX, Q_MAX).to(torch.int8)
    return q, scale.to(SCALE_DTYPE)
