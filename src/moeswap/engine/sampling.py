"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with a seeded generator.

Owns the sampling parameters' validation (every caller gets it); logits that are NaN or infinite raise
NonFiniteError (engine.nonfinite). Entry points: `SamplingParams`, `sample(logits, params, generator)`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from moeswap.engine.nonfinite import NonFiniteError, all_finite

# Logits are divided by the temperature in fp32: below the smallest normal fp32 the divisor rounds to a
# denormal or 0 and the quotients to inf or NaN.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_real(t) or not math.isfinite(t):
            raise ValueError(f"temperature must be a finite number, got {t!r}")
        if t < 0:
            raise ValueError(f"temperature must be >= 0, got {t}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.3g} "
                             f"(the smallest normal float32), got {t}")
        if not _is_int(k):
            raise ValueError(f"top_k must be an integer, got {k!r}")
        if k < 0:
            raise ValueError(f"top_k must be >= 0, got {k}")
        if not _is_real(p) or not 0 < p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {p}")


def sample(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B] (int64, on the logits' device). Logits must be finite (NonFiniteError otherwise)."""
    if params.temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / params.temperature
    if not all_finite(logits):
        if not all_finite(logits_BV):
            raise NonFiniteError("cannot sample from logits that hold NaN or Inf")
        # a small temperature overflowed fp32: the same distribution from logits shifted to a maximum of 0
        shifted = logits_BV.float() - logits_BV.float().amax(dim=-1, keepdim=True)
        logits = shifted / params.temperature
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
