"""Generation over the model: prefill each prompt, and decode the prompts done one token per step, through
the continuous-batching scheduler (engine.scheduler) with every request submitted at once.

Tokenizer-free (token ids in, token ids out). Time to first token and per output token are measured
inside the engine; a result names the paths that ran (its decode step, the MoE blocks' expert executor).
Logits that are not finite raise NonFiniteError (engine.nonfinite). Entry points:
`generate(model, prompt_ids, config, on_token)`, `generate_batch(...)`.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from moeswap.engine.sampling import SamplingParams, TokenConstraint
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler, check_seed
from moeswap.experts.executors import executor_names


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    stop_ids: Sequence[int] | None = None  # None -> the model's eos ids; () -> never stop early
    max_prompt_tokens: int | None = None  # None -> config.max_position_embeddings
    adapter: int = 0  # the LoRA adapter slot every prompt uses (lora.serving.load_adapters; 0: none)
    # structured output: makes each prompt's own constraint (they are stateful); None: free tokens
    constraint: Callable[[], TokenConstraint] | None = None

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")
        if self.seed is not None:
            check_seed(self.seed)
        if self.max_prompt_tokens is not None and (not _is_int(self.max_prompt_tokens) or self.max_prompt_tokens < 1):
            raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {self.max_prompt_tokens!r}")


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    decoded: int = field(default=0)  # tokens produced by decode steps (all but the first)
    native_steps: int = 0  # the batch's decode steps on the fast step (native C call on the CPU, CUDA graphs)
    native_off: str | None = None  # why the last decode step did not, if it did not
    state_bytes: int = 0  # the most sequence state the batch held at once (EngineStats.state_bytes_peak)
    graph_capture_s: float = 0.0  # of decode_s, capturing CUDA graphs (EngineStats.graph_capture_s)
    decode_step: str | None = None  # the batch's last decode step: EngineStats.decode_step (None: none ran)
    # the MoE blocks' expert executor (experts/executors.py names; distinct ones joined by "+"): prefill and eager
    # decode steps; a "cuda-graph" decode step runs its experts through "cuda-graph-table"
    expert_executor: str = ""

    @property
    def decode_tokens_per_s(self) -> float | None:
        """None (JSON null) when no token was decoded: only the prefill's token."""
        return self.decoded / self.decode_s if self.decoded else None


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
             on_token: Callable[[int], bool | None] | None = None,
             engine: EngineConfig | None = None) -> GenerationResult:
    return generate_batch(model, [prompt_ids], cfg, on_token=(lambda i, t: on_token(t)) if on_token else None,
                          engine=engine)[0]


def generate_batch(model, prompts: Sequence[Sequence[int]], cfg: GenerationConfig = GenerationConfig(),
                   on_token: Callable[[int, int], bool | None] | None = None,
                   engine: EngineConfig | None = None) -> list[GenerationResult]:
    """Greedy results equal running each prompt alone: each prompt is prefilled alone (in pieces, between
    the decode steps of the prompts already done), and decoded with the others (the scheduler with every
    request submitted at once). Sequence i of a seeded sampled batch uses seed + i.

    on_token(i, token) is called with each token of sequence i as it comes; returning True ends that sequence
    there (finish reason "stop": the caller found a stop string in its text)."""
    for p in prompts:
        _check_prompt(model, p, cfg)
    stop = tuple(model.config.eos_token_ids if cfg.stop_ids is None else cfg.stop_ids)
    longest = max(len(p) for p in prompts) + cfg.max_tokens
    engine = engine or EngineConfig(max_batch=len(prompts), max_len=longest)
    if engine.max_len < longest:
        engine = replace(engine, max_len=longest)
    sched = Scheduler(model, engine)
    requests = [Request(list(p), cfg.max_tokens, cfg.sampling, stop, None if cfg.seed is None else cfg.seed + i, i,
                        adapter=cfg.adapter, constraint=None if cfg.constraint is None else cfg.constraint())
                for i, p in enumerate(prompts)]
    stopped: set[int] = set()

    def each(ev) -> None:
        if ev.token is not None and on_token is not None and on_token(ev.id, ev.token) and ev.finish_reason is None:
            sched.abort(ev.id)  # its last event, at the next step, carries no token
            stopped.add(ev.id)

    # raises the first failed request's error (NonFiniteError) once the others are done
    results = sched.run(requests, each)
    st = sched.stats
    executor = executor_names(model.moe_blocks())
    return [GenerationResult(r.tokens, "stop" if r.id in stopped else r.finish_reason, r.prompt_tokens, r.ttft_s,
                             r.decode_s, r.decoded, st.native_steps, st.native_off, st.state_bytes_peak,
                             st.graph_capture_s, st.decode_step, executor) for r in results]
