"""Gated activations of the MLPs and experts: SwiGLU and K3's SiTU-GLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def glu(act: str, gate: torch.Tensor, up: torch.Tensor, situ_betas: tuple[float, float] = (4.0, 25.0)) -> torch.Tensor:
    """act(gate) * up. SiTU soft-caps both halves: b1 tanh(g/b1) sigmoid(g) * b2 tanh(u/b2)."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        b1, b2 = situ_betas
        return (b1 * torch.tanh(gate / b1) * torch.sigmoid(gate)) * (b2 * torch.tanh(up / b2))
    raise ValueError(f"unknown activation {act!r}")
