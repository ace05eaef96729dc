"""Block attention residuals (K3): each sublayer reads a softmax mix over depth of the banked
partial sums and the running one, scored by a learned vector. Without a bank it is the identity,
which makes the plain pre-norm residual stream a special case (Kimi Linear).
Shapes: S sources, N tokens (flattened batch x time), D width.
"""

from __future__ import annotations

import torch
from torch import nn

from moeswap.models.layers.basic import derived, rms_norm
from moeswap.ops import cpu_kernels


def score_vector(norm: nn.Module, proj: nn.Module) -> torch.Tensor:
    """w = res_norm.weight * res_proj.weight[0], in fp32 (the checkpoint stores the two factors)."""
    return derived(norm, "score", lambda: norm.weight.float() * proj.weight.float()[0], norm.weight, proj.weight)


def mix(partial: torch.Tensor, bank: list[torch.Tensor], score_D: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax over sources [bank..., partial] of <rmsnorm(source), w>; returns the mix of raw sources.
    Eager fp32 CPU inference runs it as one C pass (cpu_kernels.res_mix), else `mix_reference`."""
    if not bank:
        return partial
    kernel = cpu_kernels.for_inference(partial, score_D, *bank)
    if kernel is not None and partial.dtype == score_D.dtype == torch.float32 and partial.numel() and all(
            b.dtype == torch.float32 for b in bank):
        return kernel.res_mix([*bank, partial], score_D, eps)
    return mix_reference(partial, bank, score_D, eps)


def mix_reference(partial: torch.Tensor, bank: list[torch.Tensor], score_D: torch.Tensor, eps: float) -> torch.Tensor:
    """`mix` in torch ops (autograd, other devices, the kernel's oracle); bank not empty."""
    sources_S = torch.stack([*bank, partial], dim=0).float()
    logits_S = rms_norm(sources_S, None, eps) @ score_D
    probs_S = logits_S.softmax(dim=0)
    return (probs_S.unsqueeze(-1) * sources_S).sum(0).to(partial.dtype)
