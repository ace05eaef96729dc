"""Block attention residuals (K3): each sublayer reads a softmax mix over depth of the banked
partial sums and the running one, scored by a learned vector. Without a bank it is the identity,
which makes the plain pre-norm residual stream a special case (Kimi Linear).
Shapes: S sources, N tokens (flattened batch x time), D width.
"""

from __future__ import annotations

import torch
from torch import nn

from moeswap.models.layers.basic import rms_norm


def score_vector(norm: nn.Module, proj: nn.Module) -> torch.Tensor:
    """w = res_norm.weight * res_proj.weight[0], in fp32 (the checkpoint stores the two factors)."""
    return norm.weight.float() * proj.weight.float()[0]


def mix(partial: torch.Tensor, bank: list[torch.Tensor], score_D: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax over sources [bank..., partial] of <rmsnorm(source), w>; returns the mix of raw sources."""
    if not bank:
        return partial
    sources_S = torch.stack([*bank, partial], dim=0).float()
    logits_S = rms_norm(sources_S, None, eps) @ score_D
    probs_S = logits_S.softmax(dim=0)
    return (probs_S.unsqueeze(-1) * sources_S).sum(0).to(partial.dtype)
