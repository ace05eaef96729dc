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
