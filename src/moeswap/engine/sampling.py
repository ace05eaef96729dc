"""Next-token choice from logits: greedy, or temperature / top-k / top-p sampling with a seeded generator,
after the repetition penalties a request asks for, among the tokens a request's constraint allows.

Owns the sampling parameters' validation (every caller gets it); logits that are NaN or infinite raise
NonFiniteError (engine.nonfinite). Penalties (`penalize`): `repetition_penalty` p as in transformers and
llama.cpp (a token of the prompt or the output so far: logit / p where the logit is > 0, logit * p otherwise),
then `frequency_penalty` f and `presence_penalty` r as OpenAI defines them over the output so far
(logit -= f * count + r * (count > 0)). `TokenConstraint` is what a request's rule on its next token
(structured output) must offer the scheduler; the rule itself lives outside the engine (text/structured.py:
a JSON schema through llguidance), so the engine stays tokenizer-free. Entry points: `SamplingParams`,
`TokenConstraint`, `penalize(logits, params, prompt, generated)`, `sample(logits, params, generator, allowed)`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from moeswap.engine.nonfinite import NonFiniteError, all_finite

# Logits are divided by the temperature in fp32: below the smallest normal fp32 the divisor rounds to a
# denormal or 0 and the quotients to inf or NaN.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off
    presence_penalty: float = 0.0  # 0 -> off
    frequency_penalty: float = 0.0  # 0 -> off
    repetition_penalty: float = 1.0  # 1 -> off

    @property
    def penalized(self) -> bool:
        """Whether `penalize` changes anything (the scheduler skips it, and keeps its batched argmax, if not)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails the comparison too
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or not r > 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {r!r}")
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


class TokenConstraint(Protocol):
    """One request's rule on which tokens may come next (Request.constraint; stateful: one per request). The
    scheduler asks `allowed` before each of the request's tokens, chooses among those, then calls `advance`
    with the token; when `done` turns true the request ends there (finish reason "stop")."""

    def allowed(self, mask_V: torch.Tensor) -> bool:
        """Set mask_V (bool, CPU, one entry per id of the model's vocabulary, all False) True at each token that
        may come next, at least one, and return True; or return False, leaving mask_V untouched (the scheduler
        hands it to the next constraint), where any token may come: no mask this step, and the token is chosen
        as a request without a constraint chooses it."""

    def advance(self, token: int) -> None:
        """The request's next token is `token` (one `allowed` set)."""

    @property
    def done(self) -> bool:
        """Nothing more may follow the tokens so far."""


def penalize(logits_V: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
             generated: Sequence[int]) -> torch.Tensor:
    """One sequence's logits [V] after its penalties (fp32, a new tensor; the logits themselves where
    `params.penalized` is false). `prompt`: the prompt's token ids; `generated`: the tokens chosen so far."""
    if not params.penalized:
        return logits_V
    out = logits_V.float().clone()
    dev = out.device
    if params.repetition_penalty != 1:
        seen = torch.tensor(list(prompt) + list(generated), dtype=torch.long, device=dev).unique()
        picked = out[seen]
        p = params.repetition_penalty
        out[seen] = torch.where(picked > 0, picked / p, picked * p)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        count = torch.bincount(torch.tensor(list(generated), dtype=torch.long, device=dev),
                               minlength=out.shape[-1]).float()
        out -= params.frequency_penalty * count + params.presence_penalty * (count > 0).float()
    return out


def sample(logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           allowed_BV: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids [B] (int64, on the logits' device). Logits must be finite (NonFiniteError otherwise).
    allowed_BV: bool, True where a token may be chosen (TokenConstraint.allowed); None: any."""
    if params.temperature == 0:
        return _masked(logits_BV, allowed_BV).argmax(dim=-1)
    logits = logits_BV.float() / params.temperature
    if not all_finite(logits):
        if not all_finite(logits_BV):
            raise NonFiniteError("cannot sample from logits that hold NaN or Inf")
        # a small temperature overflowed fp32: the same distribution from logits shifted to a maximum of 0
        shifted = logits_BV.float() - logits_BV.float().amax(dim=-1, keepdim=True)
        logits = shifted / params.temperature
    logits = _masked(logits, allowed_BV)  # before top-k and top-p: they choose among the allowed tokens
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


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """The logits with those of tokens not allowed at -inf (a new tensor; the logits themselves with no mask)."""
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))


def from_flags(args) -> SamplingParams:
    """options.add_sampling_flags' values as SamplingParams, every one checked (ValueError naming the flag's value),
    and the seed and stop strings too: before a model loads."""
    from moeswap.engine.scheduler import check_seed  # (it imports this module)

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if any(not s for s in args.stop):
        raise ValueError("--stop: an empty string would stop before any text; leave it out")
    if args.seed is not None:
        check_seed(args.seed, "--")
    return SamplingParams(args.temperature, args.top_k, args.top_p, args.presence_penalty, args.frequency_penalty,
                          args.repetition_penalty)
