"""Continuous batching: sequences join and leave between steps over preallocated per-sequence state.

Each `step()` first admits waiting requests into free slots (each prompt prefilled alone, in chunks:
KDA in its chunked form, or its token recurrence in one C call on the CPU; MLA over the chunk plus the
cache) and then runs one batched decode step over every live sequence (on the CPU, its layers in one
C call: engine/native_step.py). Finished sequences leave at once and their slot is reused. Greedy
results equal running each request alone. Time to first token and time per output token are measured here.
Tokenizer-free. Entry points: `Scheduler(model, EngineConfig)`, `.submit(Request)`, `.step()`, `.run()`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moeswap.engine.native_step import NativeDecode
from moeswap.engine.sampling import SamplingParams, sample
from moeswap.engine.state import SlotStates


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences decoded together
    max_len: int = 4096  # prompt + generated tokens per sequence (sizes the MLA caches)
    prefill_chunk: int = 512  # prompt tokens per forward while prefilling (bounds activation memory)
    compile: bool = False  # torch.compile the decode step's attention (eager stays the reference)
    fuse: bool = True  # one matmul for all projections of an attention layer's input (same values)
    native: bool = True  # decode steps' layers in one C call where it applies (engine/native_step.py)


@dataclass
class Request:
    prompt: Sequence[int]
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_ids: Sequence[int] = ()
    seed: int | None = None
    id: int | str | None = None  # assigned by submit() when None


@dataclass
class TokenEvent:
    id: int | str
    token: int
    finish_reason: str | None  # None while the sequence goes on; "stop" | "length" on its last token


@dataclass
class Result:
    id: int | str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float  # submit -> first token (includes waiting for a slot)
    decode_s: float  # first token -> last token
    queued_s: float = 0.0  # submit -> admitted

    @property
    def decoded(self) -> int:
        return max(0, len(self.tokens) - 1)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None (JSON null) with only the first."""
        return self.decode_s / self.decoded if self.decoded else None


@dataclass
class EngineStats:
    """Wall time the engine spent prefilling and decoding, and the tokens it did it for."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0  # sequences x steps
    decode_s: float = 0.0
    native_steps: int = 0  # decode steps whose layers ran in one C call (engine/native_step.py)
    native_off: str | None = None  # why the last decode step did not, if it did not

    def as_dict(self) -> dict:
        d = dict(vars(self))
        # None (JSON null) with nothing prefilled or decoded
        d["prefill_tokens_per_s"] = self.prefill_tokens / self.prefill_s if self.prefill_tokens else None
        d["decode_tokens_per_s"] = self.decode_tokens / self.decode_s if self.decode_tokens else None
        return d


@dataclass
class _Seq:
    req: Request
    generator: torch.Generator | None
    stop: frozenset
    t_submit: float
    t_admit: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    tokens: list[int] = field(default_factory=list)
    done: bool = False


def fuse_projections(model) -> None:
    """Fuse the projections that share an input (models.layers.basic.fuse_linears) in every attention
    layer, dense MLP and shared-expert MLP; idempotent."""
    for module in model.modules():
        if hasattr(module, "fuse_projections") and "_fused_input" not in module.__dict__:
            module.fuse_projections()


class Scheduler:
    def __init__(self, model, config: EngineConfig = EngineConfig(), dtype: torch.dtype | None = None):
        self.model, self.config = model, config
        if config.fuse:
            fuse_projections(model)
        self.device = model.model.embed_tokens.weight.device
        self.states = SlotStates(model, config.max_batch, config.max_len, dtype, self.device)
        self.waiting: deque[_Seq] = deque()
        self.live: list[_Seq] = []  # live[i] occupies slot i
        self.pending = torch.zeros(config.max_batch, dtype=torch.long, device=self.device)  # next input per slot
        self.finished: dict = {}
        self.stats = EngineStats()
        self._next_id = 0
        self._decode = model
        if config.compile:
            from moeswap.engine.compile import compile_decode

            self._decode = compile_decode(model)
        elif config.native:
            self._decode = NativeDecode(model)

    # -- public API -------------------------------------------------------------------------------
    def submit(self, req: Request) -> int | str:
        if req.id is None:
            req.id = self._next_id
            self._next_id += 1
        if len(req.prompt) + req.max_tokens > self.config.max_len:
            raise ValueError(f"request {req.id}: prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} "
                             f"exceeds the engine's max_len {self.config.max_len}")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.id}: max_tokens must be >= 1, got {req.max_tokens}")
        gen = None
        if req.sampling.temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(req.seed) if req.seed is not None else gen.seed()
        self.waiting.append(_Seq(req, gen, frozenset(req.stop_ids), time.perf_counter()))
        return req.id

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    @torch.inference_mode()  # no autograd bookkeeping at all: ~5 % of a batch-1 decode step
    def step(self) -> list[TokenEvent]:
        """Admit what fits, then one decode step over the live sequences. Returns this step's tokens."""
        events: list[TokenEvent] = []
        decoding = len(self.live)  # sequences admitted below get their first token from the prefill
        while self.waiting and len(self.live) < self.config.max_batch:
            seq = self.waiting.popleft()
            slot = len(self.live)
            self.live.append(seq)
            seq.t_admit = time.perf_counter()
            tok = self._prefill(slot, list(seq.req.prompt), seq)
            self.pending[slot] = tok
            self._emit(slot, int(tok), events)
            self.stats.prefill_tokens += len(seq.req.prompt)
            self.stats.prefill_s += seq.t_first - seq.t_admit
        if decoding:
            t0 = time.perf_counter()
            self._decode_step(decoding, events)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += decoding
        self._retire()
        return events

    def run(self, requests: Sequence[Request] = (),
            on_token: Callable[[TokenEvent], None] | None = None) -> list[Result]:
        """Submit `requests` and step until everything is done; results in submission order."""
        ids = [self.submit(r) for r in requests]
        while self.busy:
            for ev in self.step():
                if on_token:
                    on_token(ev)
        return [self.finished.pop(i) for i in ids]

    # -- internals --------------------------------------------------------------------------------
    def _prefill(self, slot: int, prompt: list[int], seq: _Seq) -> torch.Tensor:
        self.states.clear(slot)
        chunk = self.config.prefill_chunk
        logits = None
        for start in range(0, len(prompt), chunk):
            piece = torch.tensor([prompt[start:start + chunk]], device=self.device)
            logits = self.model(piece, self.states.view(slot, slot + 1), last_only=True)[:, -1]
            self.states.advance(slot, slot + 1, piece.shape[1])
        return self._sample(logits, [seq])[0]

    def _decode_step(self, n: int, events: list[TokenEvent]) -> None:
        logits = self._decode(self.pending[:n, None], self.states.view(0, n))[:, -1]
        if isinstance(self._decode, NativeDecode):
            self.stats.native_off = self._decode.reason
            self.stats.native_steps += self._decode.reason is None
        self.states.advance(0, n, 1)
        next_B = self._sample(logits, self.live[:n])
        self.pending[:n] = next_B  # the next step's input stays on the device
        for slot, tok in enumerate(next_B.tolist()):  # the one host read per step: stop checks, events
            self._emit(slot, tok, events)

    def _sample(self, logits_BV: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        if all(s.generator is None for s in seqs):
            return logits_BV.argmax(dim=-1)  # one batched op, no host round trip
        return torch.cat([sample(logits_BV[i:i + 1], s.req.sampling, s.generator) for i, s in enumerate(seqs)])

    def _emit(self, slot: int, tok: int, events: list[TokenEvent]) -> None:
        seq = self.live[slot]
        now = time.perf_counter()
        if not seq.tokens:
            seq.t_first = now
        seq.t_last = now
        seq.tokens.append(tok)
        reason = "stop" if tok in seq.stop else "length" if len(seq.tokens) >= seq.req.max_tokens else None
        events.append(TokenEvent(seq.req.id, tok, reason))
        if reason:
            seq.done = True
            r = seq.req
            self.finished[r.id] = Result(r.id, seq.tokens, reason, len(r.prompt), seq.t_first - seq.t_submit,
                                         seq.t_last - seq.t_first, seq.t_admit - seq.t_submit)

    def _retire(self) -> None:
        """Finished sequences leave; the last live sequence moves into each freed slot."""
        slot = 0
        while slot < len(self.live):
            if self.live[slot].done:
                last = len(self.live) - 1
                if slot != last:
                    self.states.move(last, slot)
                    self.pending[slot] = self.pending[last]
                    self.live[slot] = self.live[last]
                self.live.pop()  # the freed slot is cleared when the next request is admitted into it
            else:
                slot += 1
