"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B] (int64, on the logits' device)."""
    if params.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if generator is not None and generator.device != probs.device:
        probs = probs.cpu()
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits_BV.device)
