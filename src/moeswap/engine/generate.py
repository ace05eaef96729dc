"""Generation over the model: prefill each prompt, then decode the batch one token per step.

Tokenizer-free (token ids in, token ids out). Measures time to first token and decode tokens/s.
Entry points: `generate(model, prompt_ids, config, on_token)` and `generate_batch(model, prompts, config)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moeswap.engine.sampling import SamplingParams, sample
from moeswap.engine.state import stack_states


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    stop_ids: Sequence[int] | None = None  # None -> the model's eos ids; () -> never stop early
    max_prompt_tokens: int | None = None  # None -> config.max_position_embeddings


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    decoded: int = field(default=0)  # tokens produced by decode steps (all but the first)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded / self.decode_s if self.decode_s > 0 else float("nan")


class PromptError(ValueError):
    """A prompt the model cannot take (empty, too long, ids outside the vocabulary)."""


def _check_prompt(model, ids: Sequence[int], cfg: GenerationConfig) -> None:
    c = model.config
    if not ids:
        raise PromptError("the prompt is empty: give at least one token")
    limit = cfg.max_prompt_tokens or c.max_position_embeddings
    if len(ids) + cfg.max_tokens > limit:
        raise PromptError(f"prompt of {len(ids)} tokens + max_tokens {cfg.max_tokens} exceeds the limit of {limit}")
    bad = [t for t in ids if not 0 <= t < c.vocab_size]
    if bad:
        raise PromptError(f"token id {bad[0]} is outside the vocabulary 0..{c.vocab_size - 1}")


def generate(model, prompt_ids: Sequence[int], cfg: GenerationConfig = GenerationConfig(),
             on_token: Callable[[int], None] | None = None) -> GenerationResult:
    return generate_batch(model, [prompt_ids], cfg, on_token=(lambda i, t: on_token(t)) if on_token else None)[0]


@torch.no_grad()
def generate_batch(model, prompts: Sequence[Sequence[int]], cfg: GenerationConfig = GenerationConfig(),
                   on_token: Callable[[int, int], None] | None = None) -> list[GenerationResult]:
    """Greedy results equal running each prompt alone: prompts are prefilled one by one, then decoded together."""
    for p in prompts:
        _check_prompt(model, p, cfg)
    device = model.model.embed_tokens.weight.device
    stop = set(model.config.eos_token_ids if cfg.stop_ids is None else cfg.stop_ids)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed) if cfg.seed is not None else None
    t0 = time.perf_counter()
    states, first_logits = [], []
    for p in prompts:
        state = model.make_state(1)
        first_logits.append(model(torch.tensor([list(p)], device=device), state, last_only=True)[:, -1])
        states.append(state)
    next_B = sample(torch.cat(first_logits), cfg.sampling, gen)
    ttft = time.perf_counter() - t0
    state = stack_states(states) if len(states) > 1 else states[0]
    outs: list[list[int]] = [[] for _ in prompts]
    reasons = ["length"] * len(prompts)
    live = [True] * len(prompts)
    t1 = time.perf_counter()
    for step in range(cfg.max_tokens):
        for i, tok in enumerate(next_B.tolist()):
            if not live[i]:
                continue
            outs[i].append(tok)
            if on_token:
                on_token(i, tok)
            if tok in stop:
                live[i], reasons[i] = False, "stop"
            elif len(outs[i]) >= cfg.max_tokens:
                live[i] = False
        if not any(live):
            break
        # finished sequences keep a slot in the batch until all finish; their outputs are ignored
        logits = model(next_B[:, None], state)[:, -1]
        next_B = sample(logits, cfg.sampling, gen)
    decode_s = time.perf_counter() - t1
    return [GenerationResult(o, r, len(p), ttft, decode_s, max(0, len(o) - 1)) for o, r, p in zip(outs, reasons, prompts)]
