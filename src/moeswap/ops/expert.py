"""Routed-expert math on already-decoded weights: y = w2 (act(w1 x) * w3 x).

`ExpertWeights` is what an expert store hands to the MoE block. A store that computes straight
from MXFP4 bytes would hand a different object with the same `__call__`.
Shapes: T tokens, I expert input width (latent or model width), F expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeswap.ops.activation import glu


@dataclass
class ExpertWeights:
    w1_FI: torch.Tensor  # gate
    w3_FI: torch.Tensor  # up
    w2_IF: torch.Tensor  # down

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w1_FI, self.w3_FI, self.w2_IF))

    def __call__(self, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        h_TF = glu(act, x_TI @ self.w1_FI.T, x_TI @ self.w3_FI.T, situ_betas)
        return h_TF @ self.w2_IF.T


@dataclass
class MXFP4ExpertWeights:
    """An expert kept as its stored MXFP4 bytes (4.25 bits per weight); computes without keeping a
    decoded copy. This is the plain-torch reference: each call decodes, multiplies, and drops the
    decoded weights. Faster kernels register in ops and must match it."""

    w1_packed: torch.Tensor  # uint8 [F, I/2]
    w1_scale: torch.Tensor  # uint8 [F, I/32]
    w3_packed: torch.Tensor
    w3_scale: torch.Tensor
    w2_packed: torch.Tensor  # uint8 [I, F/2]
    w2_scale: torch.Tensor  # uint8 [I, F/32]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())

    def __call__(self, x_TI: torch.Tensor, act: str, situ_betas: tuple[float, float]) -> torch.Tensor:
        from moeswap.formats import mxfp4

        def w(name: str) -> torch.Tensor:
            return mxfp4.decode(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), torch.float32).to(x_TI.dtype)

        h_TF = glu(act, x_TI @ w("w1").T, x_TI @ w("w3").T, situ_betas)
        return h_TF @ w("w2").T
