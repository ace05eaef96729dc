"""Continuous batching: requests join at every step and leave between steps; prefill and decode interleave.

Each `step()` admits waiting requests into free slots, prefills at most `prefill_chunk` prompt tokens (pieces
of one or more prompts, each alone: KDA in its chunked form, or its token recurrence in one C call on the CPU;
MLA over the piece plus the cache), and then runs one batched decode step over every sequence that had
finished its prefill (on the CPU, its layers in one C call: engine/native_step.py; on CUDA, replayed
CUDA graphs: engine/cuda_graph.py), so a long prompt never
stalls the running streams. A prompt's first token comes with its last piece. Finished and aborted
sequences leave at once; the state (engine/state.py) grows and shrinks with the sequences. Rows of a batch
never mix, and results are bit-invariant to the batch up to 32 decoding sequences: every kernel of the
native decode step sums a token's outputs in one order whatever the batch (csrc/linear_bf16.c for the bf16
products), so a request's logits and greedy tokens equal those of its run alone (tests/engine/
test_engine_scheduler.py); above 32, the model's forward hands the bf16 products to torch's GEMM, which does
not promise it. Time to first token and time per output token are measured here. Every step's logits are checked for NaN
and Inf (one reduction); a sequence whose logits are not finite fails alone (finish reason "error", with a
NonFiniteError naming the step and the first non-finite layer) and the others go on.
A model serving LoRA adapters (lora.serving) gets each forward's rows' adapters (Request.adapter) set
around it; a decode step with an adapter row takes the model's forward instead of the C call. A request with a
constraint (Request.constraint, engine.sampling.TokenConstraint: structured output) chooses each token among
those it allows, and ends ("stop") on the token that completes it; requests without one take the same path
as before, and their tokens do not depend on a constrained request beside them.
Tokenizer-free. Entry points: `Scheduler(model, EngineConfig)`, `.submit(Request)`, `.step()`, `.run()`,
`.abort(id)`.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from moeswap.engine.cuda_graph import GraphedDecode
from moeswap.engine.native_step import NativeDecode
from moeswap.engine.nonfinite import NonFiniteError, all_finite, first_nonfinite
from moeswap.engine.sampling import SamplingParams, TokenConstraint, penalize, sample
from moeswap.engine.state import SlotStates
from moeswap.models.layers.basic import fuse_projections  # noqa: F401 (imported from here too)


def check_seed(seed: int, context: str = "") -> None:
    """A seed torch.Generator takes (it reads it as 64 bits, signed or not)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not -(1 << 63) <= seed < 1 << 64:
        raise ValueError(f"{context}seed must be an integer in [-2**63, 2**64), got {seed!r}")


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences decoded together
    max_len: int = 4096  # prompt + generated tokens per sequence (the most the MLA caches grow to)
    # prompt tokens a step prefills, in one or more prompts' pieces, before its decode step (bounds activation
    # memory and how long the decoding sequences wait for their next token)
    prefill_chunk: int = 512
    compile: bool = False  # torch.compile the decode step's attention (eager stays the reference)
    fuse: bool = True  # one matmul for all projections of an attention layer's input (same values)
    # the device's fast decode step where it applies: the layers in one C call on the CPU (engine/native_step.py),
    # replayed CUDA graphs on CUDA (engine/cuda_graph.py)
    native: bool = True

    def __post_init__(self):
        for name in ("max_batch", "max_len", "prefill_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")


@dataclass
class Request:
    prompt: Sequence[int]
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop_ids: Sequence[int] = ()
    seed: int | None = None
    id: int | str | None = None  # assigned by submit() when None
    # None: no log-probabilities; k >= 0: each token's event carries its log-probability and the top k, from
    # the raw logits (before temperature, top-k and top-p, as OpenAI and vLLM report them)
    logprobs: int | None = None
    adapter: int = 0  # the LoRA adapter slot its rows use (lora.serving: 1..n; 0: the base model)
    # which tokens may come next (structured output: text/structured.py); stateful, so one per request
    constraint: TokenConstraint | None = None


@dataclass
class TokenEvent:
    id: int | str
    token: int | None  # None on an "error" event: the step gave the sequence no token
    # None while the sequence goes on; "stop" | "length" on its last token; "error"; "abort" (Scheduler.abort)
    finish_reason: str | None
    logprob: float | None = None  # Request.logprobs: the token's log-probability
    top_logprobs: list[tuple[int, float]] | None = None  # ... and the k most likely (token, log-probability)
    error: str | None = None  # on an "error" event: why (its Result.error as text)


@dataclass
class Result:
    id: int | str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float | None  # submit -> first token (includes waiting for a slot); None: failed before one
    decode_s: float  # first token -> last token
    queued_s: float = 0.0  # submit -> admitted
    error: NonFiniteError | None = None  # why it failed (finish_reason "error"); tokens are those before

    @property
    def decoded(self) -> int:
        return max(0, len(self.tokens) - 1)

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None (JSON null) with only the first."""
        return self.decode_s / self.decoded if self.decoded else None


@dataclass
class EngineStats:
    """Wall time the engine spent prefilling and decoding, the tokens it did it for, and its sequence state."""

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0  # sequences x steps
    decode_s: float = 0.0
    native_steps: int = 0  # decode steps that took the fast step (one C call on the CPU, CUDA graphs on CUDA)
    native_off: str | None = None  # why the last decode step did not, if it did not
    # which decode step the last one took: "native-c" (engine/native_step.py), "cuda-graph" (engine/cuda_graph.py),
    # "compiled" (engine/compile.py) or "reference" (the model's modules); None before any
    decode_step: str | None = None
    # CUDA graphs captured for decode steps (a batch size's first step, and again after the state's buffers
    # moved: engine/cuda_graph.py) and the time that took, which decode_s includes
    graph_captures: int = 0
    graph_capture_s: float = 0.0
    # sequence state (KDA and MLA buffers, engine/state.py) at the end of the last step's work, before the
    # sequences that finished left: bytes allocated, sequences holding them; and the most bytes at that point
    state_bytes: int = 0
    state_sequences: int = 0
    state_bytes_peak: int = 0

    @property
    def state_bytes_per_sequence(self) -> float | None:
        """Bytes of state per live sequence at the end of the last step's work; None with none."""
        return self.state_bytes / self.state_sequences if self.state_sequences else None

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["state_bytes_per_sequence"] = self.state_bytes_per_sequence
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
    order: int = 0  # admission order (prefill goes first come, first served)
    prefilled: int = 0  # prompt tokens in the state
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    aborted: bool = False  # Scheduler.abort: ends at the next step
    error: NonFiniteError | None = None
    logprobs: tuple[float, list[tuple[int, float]]] | None = None  # of the token _sample just chose


class Scheduler:
    def __init__(self, model, config: EngineConfig = EngineConfig(), dtype: torch.dtype | None = None):
        self.model, self.config = model, config
        if config.fuse:
            fuse_projections(model)
        self.device = model.model.embed_tokens.weight.device
        self.states = SlotStates(model, config.max_batch, config.max_len, dtype, self.device)
        self.waiting: deque[_Seq] = deque()
        self.live: list[_Seq] = []  # live[i] occupies slot i
        self.decoding = 0  # live[:decoding] are past their prefill (decoded each step); the rest prefill
        self._admitted = 0  # admissions so far: the prefill order
        self._generation = self.states.generation  # of the buffers the native step last saw
        self.pending = torch.zeros(config.max_batch, dtype=torch.long, device=self.device)  # next input per slot
        self.finished: dict = {}
        self.stats = EngineStats()
        self._next_id = 0
        self._blank: torch.Tensor | None = None  # an all-False mask for the next constraint (_allowed)
        self._aborted: list[_Seq] = []  # aborted while waiting: their "abort" event comes with the next step
        # served LoRA adapters (lora.serving): which slot each row of a forward uses is set around it
        self.rows = getattr(model, "adapter_rows", None)
        self._decode = model
        if config.compile and self.rows is not None:
            raise ValueError("EngineConfig.compile does not apply to a model serving LoRA adapters")
        compiled = None
        if config.compile:
            from moeswap.engine.compile import compile_decode

            compiled = self._decode = compile_decode(model)
        if config.native and self.device.type == "cuda":  # graphs, of the compiled attention with compile
            self._decode = GraphedDecode(model, compiled=compiled)
        elif config.native and not config.compile:
            self._decode = NativeDecode(model)

    # -- public API -------------------------------------------------------------------------------
    def submit(self, req: Request) -> int | str:
        if req.id is None:
            req.id = self._next_id
            self._next_id += 1
        if len(req.prompt) + req.max_tokens > self.config.max_len:
            raise ValueError(f"request {req.id}: prompt of {len(req.prompt)} tokens + max_tokens {req.max_tokens} "
                             f"exceeds the engine's max_len {self.config.max_len}")
        if not len(req.prompt):
            raise ValueError(f"request {req.id}: the prompt is empty: give at least one token")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.id}: max_tokens must be >= 1, got {req.max_tokens}")
        if req.seed is not None:
            check_seed(req.seed, f"request {req.id}: ")
        count = self.rows.count if self.rows is not None else 0
        if isinstance(req.adapter, bool) or not isinstance(req.adapter, int) or not 0 <= req.adapter <= count:
            raise ValueError(f"request {req.id}: adapter {req.adapter!r} does not exist (this model serves "
                             + (f"adapters 1..{count}; 0 is none)" if count else "no adapters: give 0)"))
        gen = None
        if req.sampling.temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(req.seed) if req.seed is not None else gen.seed()
        self.waiting.append(_Seq(req, gen, frozenset(req.stop_ids), time.perf_counter()))
        return req.id

    def abort(self, request_id) -> bool:
        """End a request: a waiting one leaves the queue now, a running one at the next step (its slot and
        state are freed there). Either way the next `step()` gives its last event, (id, None, "abort"), and
        `finished` its Result (finish reason "abort", the tokens it had). False: no such request waits or runs."""
        for seq in self.waiting:
            if seq.req.id == request_id:
                self.waiting.remove(seq)
                seq.t_admit = time.perf_counter()
                self._aborted.append(seq)
                return True
        for seq in self.live:
            if seq.req.id == request_id and not seq.aborted:
                seq.aborted = True
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live or self._aborted)

    @torch.inference_mode()  # no autograd bookkeeping at all: ~5 % of a batch-1 decode step
    def step(self) -> list[TokenEvent]:
        """Admit what fits, prefill up to `prefill_chunk` prompt tokens, then one decode step over the
        sequences that were past their prefill before. Returns this step's tokens."""
        events: list[TokenEvent] = []
        self._end_aborted(events)
        while self.waiting and len(self.live) < self.config.max_batch:
            seq = self.waiting.popleft()
            self.states.clear(len(self.live))
            self.live.append(seq)
            seq.t_admit, seq.order = time.perf_counter(), self._admitted
            self._admitted += 1
        decoding = self.decoding  # a prompt done below got its first token from the prefill: it decodes next step
        self._prefill(events)
        if decoding:
            t0 = time.perf_counter()
            self._decode_step(decoding, events)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += decoding
        st = self.stats
        st.state_bytes, st.state_sequences = self.states.nbytes(), len(self.live)
        st.state_bytes_peak = max(st.state_bytes_peak, st.state_bytes)
        self._retire()
        return events

    def run(self, requests: Sequence[Request] = (),
            on_token: Callable[[TokenEvent], None] | None = None) -> list[Result]:
        """Submit `requests` and step until everything is done; results in submission order. If one of them
        failed, raises its error (the first in submission order) once the others are done; `step()` gives
        each request's outcome instead."""
        ids = [self.submit(r) for r in requests]
        while self.busy:
            for ev in self.step():
                if on_token:
                    on_token(ev)
        results = [self.finished.pop(i) for i in ids]
        failed = next((r for r in results if r.error is not None), None)
        if failed is not None:
            raise failed.error
        return results

    # -- internals --------------------------------------------------------------------------------
    def _prefill(self, events: list[TokenEvent]) -> None:
        """Up to `prefill_chunk` prompt tokens of the sequences still prefilling, in the order they were
        admitted; a prompt is cut at multiples of `prefill_chunk` (so its pieces are those it has alone)
        and one whose next piece does not fit the tokens left waits for the next step. A prompt whose last
        piece is done gets its first token and joins the decoding rows."""
        chunk = budget = self.config.prefill_chunk
        for seq in sorted(self.live[self.decoding:], key=lambda s: s.order):
            prompt = seq.req.prompt
            n = min(chunk, len(prompt) - seq.prefilled)
            if seq.done or n > budget:
                continue
            t0 = time.perf_counter()
            slot = self.live.index(seq)
            self._reserve(slot, slot + 1, n)
            piece = torch.tensor([list(prompt[seq.prefilled:seq.prefilled + n])], device=self.device)
            with self._adapters(seq.req.adapter):
                logits = self.model(piece, self.states.view(slot, slot + 1), last_only=True)[:, -1]
            self.states.advance(slot, slot + 1, n)
            seq.prefilled += n
            budget -= n
            self.stats.prefill_tokens += n
            if seq.prefilled == len(prompt):
                if not all_finite(logits):
                    self._fail(slot, events)
                else:
                    tok = self._sample(logits, [seq])[0]
                    self.pending[slot] = tok
                    self._emit(slot, int(tok), events)
                    if not seq.done:  # into the decoding rows 0..decoding-1
                        self._swap(slot, self.decoding)
                        self.decoding += 1
            self.stats.prefill_s += time.perf_counter() - t0
            if not budget:
                break

    def _adapters(self, slots):
        """The adapter slot of every row (int) or of each row (list) for the forwards inside the block."""
        return self.rows.use(slots) if self.rows is not None else nullcontext()

    def _reserve(self, start: int, stop: int, tokens: int) -> None:
        """Room in the state for a forward."""
        self.states.reserve(start, stop, tokens)
        self._reallocated()

    def _reallocated(self) -> None:
        """Where the state's buffers were reallocated, the native step's table of pointers into the old ones
        is dropped, and with it the old buffers (it would be rebuilt anyway: the views are new objects)."""
        if self.states.generation != self._generation:
            self._generation = self.states.generation
            if isinstance(self._decode, (NativeDecode, GraphedDecode)):
                self._decode.forget_state()

    def _step_name(self) -> str:
        """The decode step the last step took (EngineStats.decode_step): the fast step unless it declined."""
        d = self._decode
        if isinstance(d, NativeDecode) and d.reason is None:
            return "native-c"
        if isinstance(d, GraphedDecode) and d.reason is None:
            return "cuda-graph"
        return "reference" if d is self.model or isinstance(d, (NativeDecode, GraphedDecode)) else "compiled"

    def _decode_step(self, n: int, events: list[TokenEvent]) -> None:
        self._reserve(0, n, 1)
        with self._adapters([seq.req.adapter for seq in self.live[:n]]):
            logits = self._decode(self.pending[:n, None], self.states.view(0, n))[:, -1]
        if isinstance(self._decode, (NativeDecode, GraphedDecode)):
            self.stats.native_off = self._decode.reason
            self.stats.native_steps += self._decode.reason is None
        if isinstance(self._decode, GraphedDecode):
            self.stats.graph_captures, self.stats.graph_capture_s = self._decode.captures, self._decode.capture_s
        self.stats.decode_step = self._step_name()
        self.states.advance(0, n, 1)
        bad: set[int] = set()
        if not all_finite(logits):  # one reduction per step; rows only when it fails
            bad = set((~torch.isfinite(logits).all(dim=-1)).nonzero().flatten().tolist())
        next_B = self._sample(logits, self.live[:n], bad)
        self.pending[:n] = next_B  # the next step's input stays on the device
        for slot, tok in enumerate(next_B.tolist()):  # the one host read per step: stop checks, events
            if slot in bad:
                self._fail(slot, events)
            else:
                self._emit(slot, tok, events)

    def _sample(self, logits_BV: torch.Tensor, seqs: list[_Seq], skip: set[int] = frozenset()) -> torch.Tensor:
        """Each sequence's next token; rows in `skip` (failed) get 0 and draw nothing from their generator.
        Sequences whose request asks for log-probabilities get them (seq.logprobs, for _emit), from the raw
        logits; the tokens are chosen from the logits after each request's penalties (greedy ones too), among
        those its constraint allows."""
        raw_BV = logits_BV
        masks = {i: self._allowed(s.req.constraint, logits_BV.shape[-1]) for i, s in enumerate(seqs)
                 if s.req.constraint is not None and i not in skip}
        allowed = {i: mask for i, mask in masks.items() if mask is not None}  # (None: any token, as unconstrained)
        if any(s.req.sampling.penalized for s in seqs):
            # fp32 holds every bf16 value exactly: unpenalized rows keep their argmax (ties included)
            logits_BV = logits_BV.to(torch.float32, copy=True)  # the raw ones stay for logprobs
            for i, s in enumerate(seqs):
                if i not in skip and s.req.sampling.penalized:
                    logits_BV[i] = penalize(logits_BV[i], s.req.sampling, s.req.prompt, s.tokens)
        if not allowed and all(s.generator is None for s in seqs):
            tokens_B = logits_BV.argmax(dim=-1)  # one batched op, no host round trip
        else:  # (an unconstrained greedy row's argmax alone is the batched one's)
            none = torch.zeros(1, dtype=torch.long, device=logits_BV.device)
            tokens_B = torch.cat([none if i in skip else sample(logits_BV[i:i + 1], s.req.sampling, s.generator,
                                                                allowed.get(i))
                                  for i, s in enumerate(seqs)])
        rows = [i for i, s in enumerate(seqs) if s.req.logprobs is not None and i not in skip]
        if rows:
            lp_RV = raw_BV[rows].float().log_softmax(-1)
            chosen = lp_RV.gather(-1, tokens_B[rows].unsqueeze(-1)).squeeze(-1).tolist()
            k = min(max(seqs[i].req.logprobs for i in rows), lp_RV.shape[-1])
            top_v, top_i = lp_RV.topk(k, dim=-1) if k else (lp_RV[:, :0], lp_RV[:, :0].long())
            top_v, top_i = top_v.tolist(), top_i.tolist()
            for r, i in enumerate(rows):
                n = seqs[i].req.logprobs
                seqs[i].logprobs = chosen[r], list(zip(top_i[r][:n], top_v[r][:n]))
        return tokens_B

    def _allowed(self, constraint: TokenConstraint, vocab: int) -> torch.Tensor | None:
        """The constraint's mask over the vocabulary [1, V] (on the CPU: the constraint writes it); None where
        it allows any token this step. A constraint that says so leaves its blank mask as it was, and the next
        one gets it: a step without a mask allocates and clears nothing."""
        mask, self._blank = self._blank, None  # (a constraint that raises may have written to it)
        if mask is None or mask.shape[-1] != vocab:
            mask = torch.zeros(1, vocab, dtype=torch.bool)
        if constraint.allowed(mask[0]) is False:
            self._blank = mask
            return None
        if not bool(mask.any()):
            raise RuntimeError(f"{type(constraint).__name__} allowed no token")
        return mask

    def _fail(self, slot: int, events: list[TokenEvent]) -> None:
        """The sequence in `slot` produced logits that are not finite: it ends with a NonFiniteError that
        names the step and (re-running it through the model's modules) the first non-finite layer. Its slot
        is wiped, so that nothing non-finite stays behind for the slot's next occupant."""
        seq = self.live[slot]
        r, prompt = seq.req, list(seq.req.prompt)
        # the step's input: the prompt (prefill), or the last token (decode step k makes token k + 1)
        prefix, step = (prompt + seq.tokens[:-1], seq.tokens[-1:]) if seq.tokens else ([], prompt)
        where = f"decode step {len(seq.tokens)}" if seq.tokens else "prefill"
        with self._adapters(r.adapter):
            origin = first_nonfinite(self.model, prefix, step, self.config.prefill_chunk, self.states.dtype,
                                     self.device)
        seq.error = NonFiniteError(
            f"request {r.id}: NaN or infinite logits at {where} (prompt of {len(prompt)} tokens, {len(seq.tokens)} "
            f"generated); first non-finite output, re-running the step through the model's modules: {origin}; "
            f"a weight or a config.json value is NaN, infinite or out of range")
        self.states.wipe(slot)
        seq.done = True
        now = time.perf_counter()
        seq.t_last, seq.t_first = now, seq.t_first or now
        events.append(TokenEvent(r.id, None, "error", error=str(seq.error)))
        self.finished[r.id] = Result(r.id, seq.tokens, "error", len(prompt),
                                     seq.t_first - seq.t_submit if seq.tokens else None,
                                     seq.t_last - seq.t_first, seq.t_admit - seq.t_submit, seq.error)

    def _emit(self, slot: int, tok: int, events: list[TokenEvent]) -> None:
        seq = self.live[slot]
        now = time.perf_counter()
        if not seq.tokens:
            seq.t_first = now
        seq.t_last = now
        seq.tokens.append(tok)
        constraint = seq.req.constraint
        if constraint is not None:
            constraint.advance(tok)
        reason = ("stop" if tok in seq.stop or (constraint is not None and constraint.done) else
                  "length" if len(seq.tokens) >= seq.req.max_tokens else None)
        logprob, top = seq.logprobs if seq.logprobs is not None else (None, None)
        seq.logprobs = None
        events.append(TokenEvent(seq.req.id, tok, reason, logprob, top))
        if reason:
            seq.done = True
            r = seq.req
            self.finished[r.id] = Result(r.id, seq.tokens, reason, len(r.prompt), seq.t_first - seq.t_submit,
                                         seq.t_last - seq.t_first, seq.t_admit - seq.t_submit)

    def _end_aborted(self, events: list[TokenEvent]) -> None:
        """Aborted requests end: an "abort" event and Result each; running ones leave their slots."""
        ended = self._aborted + [seq for seq in self.live if seq.aborted]
        self._aborted = []
        for seq in ended:
            seq.done = True
            r = seq.req
            events.append(TokenEvent(r.id, None, "abort"))
            self.finished[r.id] = Result(r.id, seq.tokens, "abort", len(r.prompt),
                                         seq.t_first - seq.t_submit if seq.tokens else None,
                                         seq.t_last - seq.t_first if seq.tokens else 0.0, seq.t_admit - seq.t_submit)
        if ended:
            self._retire()

    def _retire(self) -> None:
        """Finished sequences leave; the rows stay packed: the last decoding sequence moves into a freed
        decoding slot (and the last prefilling one into its place), the last prefilling one into a freed
        prefilling slot. Then the state shrinks to what is left, where that is far less."""
        for i in reversed(range(len(self.live))):  # from the end: every sequence after i stays
            if not self.live[i].done:
                continue
            last = len(self.live) - 1
            if i < self.decoding:
                self.decoding -= 1
                self._move(self.decoding, i)
                self._move(last, self.decoding)
            else:
                self._move(last, i)
            self.live.pop()
        self.states.fit(len(self.live))
        self._reallocated()

    def _move(self, src: int, dst: int) -> None:
        if src != dst:
            self.states.move(src, dst)
            self.pending[dst] = self.pending[src]
            self.live[dst] = self.live[src]

    def _swap(self, a: int, b: int) -> None:
        if a != b:
            self.states.swap(a, b)
            self.pending[[a, b]] = self.pending[[b, a]]
            self.live[a], self.live[b] = self.live[b], self.live[a]
