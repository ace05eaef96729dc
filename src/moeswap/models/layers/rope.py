"""Rotary position embedding of MLA's shared key (DeepSeek-V3 / Kimi K2), with YaRN context scaling.

Owns the inverse frequencies (YaRN: blended between interpolated and extrapolated over a ramp of
dimensions, as the YaRN paper and DeepSeek-V3's config define it), the cos/sin of given positions, the
rotation of pairs, and the softmax-scale factor YaRN asks for (mscale^2). Knows nothing of caches:
the caller gives positions. Entry point: `Rotary(RopeConfig, dim)`.
Shapes: ... any leading dims, R rotary dims (even), R/2 frequencies.
"""

from __future__ import annotations

import math

import torch

from moeswap.config import RopeConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(r: RopeConfig, dim: int) -> torch.Tensor:
    """Per frequency pair: extrapolated (unscaled) for dims that rotate more than beta_fast times over the
    original context, interpolated (divided by factor) for those rotating fewer than beta_slow times, a
    linear ramp between."""
    extrapolated = 1.0 / r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated = extrapolated / r.factor

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` in the context
        return dim * math.log(r.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = dim_of(r.beta_fast), dim_of(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


class Rotary:
    """cos/sin of positions and the rotation of the last dim of q_r / k_r (not a module: no parameters)."""

    def __init__(self, r: RopeConfig, dim: int):
        self.interleave, self.dim = r.interleave, dim
        if r.yarn:
            self.inv_freq = _yarn_inv_freq(r, dim)
            if r.attention_factor is not None:
                self.attention_factor = r.attention_factor
            elif r.mscale and r.mscale_all_dim:
                self.attention_factor = yarn_mscale(r.factor, r.mscale) / yarn_mscale(r.factor, r.mscale_all_dim)
            else:
                self.attention_factor = yarn_mscale(r.factor)
            # DeepSeek-V3 multiplies the softmax scale by mscale(factor, mscale_all_dim)^2
            m = yarn_mscale(r.factor, r.mscale_all_dim) if r.mscale_all_dim else 1.0
            self.softmax_factor = m * m
        else:
            self.inv_freq = 1.0 / r.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
            self.attention_factor, self.softmax_factor = 1.0, 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., R/2] of int positions [...], times the attention factor, in `dtype`."""
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        return ((angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., R] rotated by angles whose cos/sin broadcast to [..., R/2]. Interleaved: pair (2i, 2i+1)
        turns by angle i and stays in place; else pair (i, i + R/2)."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
