"""RMSNorm and gated MLPs (SwiGLU, K3's SiTU-GLU). Pure math, weights as named submodules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeswap.ops.activation import glu


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (as the references do), returned in x's dtype."""
    xf = x if x.dtype == torch.float32 else x.float()
    if weight is not None and weight.dtype != torch.float32:
        weight = weight.float()
    return F.rms_norm(xf, (x.shape[-1],), weight, eps).to(x.dtype)


class WeightOnly(nn.Module):
    """A bare `weight` parameter under a checkpoint name (conv kernels, norm and score vectors)."""

    def __init__(self, *shape: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(*shape, device=device))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(act(gate x) * up x): layer 0's dense MLP and the shared experts."""

    def __init__(self, dim: int, hidden: int, act: str, situ_betas: tuple[float, float], device=None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, device=device)
        self.up_proj = nn.Linear(dim, hidden, bias=False, device=device)
        self.down_proj = nn.Linear(hidden, dim, bias=False, device=device)
        self.act, self.situ_betas = act, situ_betas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.act, self.gate_proj(x), self.up_proj(x), self.situ_betas))
