"""compressed-tensors `pack-quantized` INT4 (Kimi K2-Thinking's routed experts): symmetric signed 4-bit
integers q in [-8, 7], eight per int32 word (element 8w + i at bits 4i..4i+3 of word w, stored as q + 8),
`weight_packed` int32 [out, ceil(in/8)], one `weight_scale` per group of 32 inputs [out, in/32] (bf16 in the
published files), `weight_shape` int32 [2]. W = q * scale, the product taken in the scale's dtype, as
compressed-tensors dequantises (so bf16 scales give bf16-rounded weights).

Pure functions on tensors; knows nothing of checkpoints or module names.
Entry points: `decode(packed, scale, shape)`, `encode(w)`.
"""

from __future__ import annotations

import math

import torch

GROUP = 32
Q_MIN, Q_MAX = -8, 7


def packed_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return shape[0], math.ceil(shape[1] / 8)


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return shape[0], shape[1] // GROUP


def decode(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int],
           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """weight_packed int32 [out, ceil(in/8)] + weight_scale float [out, in/32] -> [out, in] = q * scale (in the
    scale's dtype), then cast to `dtype`."""
    out_dim, in_dim = shape
    if packed.dtype != torch.int32 or tuple(packed.shape) != packed_shape(shape):
        raise ValueError(f"INT4 weight_packed for shape {list(shape)} must be int32 of shape "
                         f"{list(packed_shape(shape))}, found {packed.dtype} of shape {list(packed.shape)}")
    if in_dim % GROUP or not scale.is_floating_point() or tuple(scale.shape) != scale_shape(shape):
        raise ValueError(f"INT4 weight_scale for shape {list(shape)} must be a float tensor of shape "
                         f"{list(scale_shape(shape))} (one per {GROUP} inputs), found {scale.dtype} of shape "
                         f"{list(scale.shape)}")
    return (codes(packed, in_dim).to(scale.dtype) * scale.repeat_interleave(GROUP, dim=1)).to(dtype)


def codes(packed: torch.Tensor, in_dim: int) -> torch.Tensor:
    """The signed codes int8 [out, in] of int32 words [out, ceil(in/8)] (shifts, not byte views: the same on
    any host byte order)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # arithmetic shift; the mask drops the sign bits
    return (nibbles.flatten(-2)[..., :in_dim] - 8).to(torch.int8)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] [out, in] -> int32 words [out, ceil(in/8)] (zero bits pad the last word, as
    compressed-tensors packs)."""
    out_dim, in_dim = q.shape
    u = torch.zeros(out_dim, packed_shape((out_dim, in_dim))[1] * 8, dtype=torch.int64)
    u[:, :in_dim] = q.to(torch.int64) + 8
    words = (u.view(out_dim, -1, 8) << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # two's complement


def encode(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [out, in] -> (weight_packed, weight_scale): per group scale = amax / 7.5 (compressed-tensors'
    symmetric range), stored in `scale_dtype`; q = round(w / scale) to even, clamped to [-8, 7]. An all-zero
    group gets scale 1."""
    if not w.is_floating_point() or w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"INT4 encode needs a 2-D float tensor with inputs a multiple of {GROUP}, got {w.dtype} "
                         f"of shape {tuple(w.shape)}")
    groups = w.float().view(w.shape[0], -1, GROUP)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, amax / ((Q_MAX - Q_MIN) / 2), 1.0).to(scale_dtype)
    q = (groups / scale.float()[..., None]).round().clamp(Q_MIN, Q_MAX).to(torch.int8).view(w.shape)
    return pack(q), scale
