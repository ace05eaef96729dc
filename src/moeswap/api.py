"""The Python API in the shape vllm.LLM and llama_cpp.Llama users reach for: `moeswap.load(path, **options)`
returns an `LLM` with `generate`, `stream`, `chat` and `chat_stream`.

Owns: load options as keyword arguments (options.LoadOptions' fields; byte counts also as "2GiB"), the
tokenization around the tokenizer-free engine (as the server does it: text.tokenizer for prompts and chat
templates, text.output for streamed text, stop strings and a chat answer's reasoning and tool calls), the
keywords of a call (`Params`, one dataclass for all four methods), and one continuous-batching Scheduler
per LLM (engine.scheduler) that every call's requests share, so a call's prompts are decoded together and
open streams advance together. Process tuning on first use (tuning.tune_process). Importing this module
imports no torch: `load` tunes the process first, then loads. Not thread-safe: one thread drives an LLM
(`moeswap serve` serves concurrent clients). Entry points: `load`, `LLM`, `Completion`, `Params`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from moeswap import tuning
from moeswap.hub import resolve_model
from moeswap.options import LoadOptions, default_model_dir
from moeswap.text.output import ChatOutput, TextOutput, prompt_tail  # torch-free (tokenizers, Jinja2)
from moeswap.units import parse_bytes

if TYPE_CHECKING:
    from moeswap.engine.scheduler import EngineConfig, Request, Scheduler, TokenEvent
    from moeswap.text.tokenizer import Tokenizer

CHAT_MAX_TOKENS = 256  # chat's default max_tokens (an answer runs longer than a completion's 64)
LORA_NAME = "adapter"  # the name of the one adapter `load(lora=PATH)` gives (generate --lora's too)


class _Unset:
    def __repr__(self) -> str:
        return "<the LLM's adapter>"


_UNSET: Any = _Unset()  # `adapter` left out: the LLM's own (`LLM.adapter`)


def load(path: str | os.PathLike | None = None, *, lora: str | os.PathLike | Mapping[str, str | os.PathLike] | None = None,
         max_batch: int = 16, max_len: int | None = None, native: bool = True, tune: bool = True,
         **options: Any) -> LLM:
    """Loads the model directory `path` (config.json + safetensors + tokenizer; None: the shipped
    models/stdlib-k3, as the commands default to; a Hugging Face name "org/name[@revision]" that is no
    directory: its snapshot in the hub cache, as the commands take it) for generation.

    options: LoadOptions' fields, as the CLI's load flags name them (expert_memory="2GiB", host_memory,
    expert_policy, prefetch, device, dtype, ...); an unknown name is a TypeError, a bad value a ValueError.
    lora: one LoRA adapter directory (PEFT format), used by every call unless it says `adapter=None`; or
    {name: directory}, served side by side, each call choosing with `adapter=name` (base model by default).
    max_batch: sequences decoded together (more prompts wait for a slot); results are the same as each prompt
    alone up to 32. max_len: prompt + generated tokens per sequence (default: the model's context, at most
    EngineConfig's 4096). native=False decodes through the model's modules (the reference), not the fast step.

    tune=True (the default) runs `moeswap.tuning.tune_process()` once per process, as the `moeswap` command
    does: large frees go back to the OS (the expert store's buffers come and go) and, on a machine whose
    cores other processes keep busy, fewer OpenMP threads. Before torch is imported (call `moeswap.load` first,
    or `tune_process()` at the top of the program) that is OMP_NUM_THREADS plus a passive wait and
    transparent huge pages, which is what keeps decode on a busy machine from running ~15x slower
    (docs/benchmarks.md); after torch is imported only the thread count can still be lowered. tune=False
    leaves the process as it is (and MOESWAP_THREADS=spin or OMP_NUM_THREADS keep the threads your own)."""
    known = {f.name: f for f in fields(LoadOptions)}
    values = {}
    for name, value in options.items():
        f = known.get(name)
        if f is None:
            raise TypeError(f"moeswap.load() got an unexpected keyword argument {name!r}; load options: "
                            f"{', '.join(known)}")
        if f.metadata["kind"] == "bytes" and isinstance(value, str):
            try:
                value = parse_bytes(value)
            except Exception as err:  # argparse.ArgumentTypeError: the flag's wording
                raise ValueError(f"{name}: {err}") from None
        values[name] = value
    load_options = LoadOptions(**values)
    path = default_model_dir() if path is None else resolve_model(os.fspath(path))
    adapters = _lora_argument(lora)
    if tune:
        tuning.tune_process()  # before torch is imported below, where it still can be
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.models.loader import load_model
    from moeswap.text.tokenizer import load_tokenizer

    read = None
    if adapters:  # read and checked against the base before the model loads
        from moeswap.lora.serving import read_adapters

        read = read_adapters(adapters, path)
    tokenizer = load_tokenizer(path)
    model, store = load_model(path, load_options)
    try:
        names: tuple[str, ...] = ()
        if read is not None:
            from moeswap.lora.serving import load_adapters

            names = load_adapters(model, read).names
        limit = model.config.max_position_embeddings
        engine = EngineConfig(max_batch=max_batch, max_len=min(limit, EngineConfig.max_len) if max_len is None
                              else max_len, native=native)
        if engine.max_len > limit:
            raise ValueError(f"max_len {engine.max_len} is more than the model's max_position_embeddings {limit}")
        llm = LLM(model, tokenizer, store, engine, names, load_options)
    except BaseException:
        store.close()
        raise
    if isinstance(lora, (str, os.PathLike)):
        llm.adapter = LORA_NAME
    return llm


def _lora_argument(lora) -> list[tuple[str, str | os.PathLike]]:
    if lora is None:
        return []
    if isinstance(lora, (str, os.PathLike)):
        return [(LORA_NAME, lora)]
    if isinstance(lora, Mapping):
        return [(str(name), directory) for name, directory in lora.items()]
    raise TypeError(f"lora: expected an adapter directory or {{name: directory}}, got {type(lora).__name__}")


@dataclass
class Completion:
    """One prompt's answer: its text (stop strings and the end-of-sequence token left out), every generated
    token id, and why it ended: "stop" (an end-of-sequence / stop token or stop string), "length"
    (max_tokens), "tool_calls" (chat with tools: the answer called them), "abort" (a stream closed early).
    chat: the reasoning the checkpoint's layout sets apart from the text, and the tool calls (OpenAI's form)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_token_ids: list[int]
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    @property
    def usage(self) -> dict[str, int]:
        """Token counts as OpenAI's API reports them."""
        prompt, completion = len(self.prompt_token_ids), len(self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Params:
    """The keywords generate, stream, chat and chat_stream take (an unknown one is a TypeError)."""

    max_tokens: int = 64  # chat and chat_stream: 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    presence_penalty: float = 0.0  # [-2, 2]; these three as the server's (engine/sampling.py), 0/0/1: off
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # sampling seed; answer k of a call gets seed + k, so a batch is each alone
    n: int = 1  # answers per prompt (generate and chat: a list of n Completion in place of one; not streams)
    stop: str | Sequence[str] = ()  # strings that end the text (left out of it)
    stop_token_ids: Sequence[int] = ()  # token ids that end it, besides the tokenizer's end of sequence
    ignore_eos: bool = False  # do not stop at the tokenizer's end-of-sequence tokens
    skip_special_tokens: bool = True  # False: control tokens are text too
    adapter: str | None = _UNSET  # a served LoRA adapter's name; None: the base model; left out: LLM.adapter
    # structured output, OpenAI's shape (text.structured): {"type": "json_object"}, or {"type": "json_schema",
    # "json_schema": {"name": ..., "schema": {...}}}; the text then parses as JSON (that follows the schema)
    response_format: Mapping[str, Any] | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop: expected non-empty strings (an empty one would stop before any text)")
        return stops


@dataclass
class _Job:
    """A submitted request and the text it has given so far; fed the scheduler's events for its id."""

    request: Request
    out: TextOutput | ChatOutput
    tokens: list[int] = field(default_factory=list)
    pending: str = ""  # text not yet taken (stream) or all of it (generate)
    finish_reason: str | None = None
    error: BaseException | str | None = None
    reasoning: str = ""


class TextStream:
    """An iterator of text pieces (LLM.stream); `close()` aborts the request. `completion`: the Completion
    once the stream has ended (its text: every piece given), None before; an aborted one's reason is "abort"."""

    def __init__(self, llm: LLM, job: _Job) -> None:
        self._job = job
        self._given = ""
        self._pieces = llm._pieces(job)  # (LLM's own generator: it owns the stepping)

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        piece = next(self._pieces)
        self._given += piece
        return piece

    def close(self) -> None:
        self._pieces.close()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def completion(self) -> Completion | None:
        job = self._job
        if job.finish_reason is None:
            return None
        return _completion(job, self._given)

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._job.request.prompt)

    @property
    def reasoning(self) -> str:
        """chat_stream: the reasoning so far (the pieces are the answer's text)."""
        return self._job.reasoning


class LLM:
    """A loaded model with its tokenizer and a scheduler (made by `moeswap.load`). Close it (or use it as a
    context manager) to stop the expert store's reader threads."""

    def __init__(self, model, tokenizer: Tokenizer, store, engine: EngineConfig, adapters: Sequence[str] = (),
                 options: LoadOptions = LoadOptions()) -> None:
        self.model, self.tokenizer, self.store, self.engine, self.options = model, tokenizer, store, engine, options
        self.adapters = tuple(adapters)  # served LoRA adapters, slot i + 1 each
        self.adapter: str | None = None  # the adapter a call uses when it names none (load(lora=PATH): it)
        self._scheduler: Scheduler | None = None
        self._jobs: dict[int | str, _Job] = {}

    # -- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
                 **params: Any) -> Any:
        """Completes a prompt (a string, or a list of token ids) -> Completion, or a list of prompts -> a
        list of Completion, all submitted at once and decoded together (continuous batching: max_batch at a
        time). Keywords: `Params` (max_tokens=64, temperature=0 greedy, top_p, top_k, seed, stop, ...).
        With n > 1 each prompt's Completion becomes a list of n (answer j of prompt i samples with seed +
        i·n + j). Generation stops at the tokenizer's end-of-sequence tokens unless ignore_eos."""
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and bool(prompts)
                                              and all(_is_id(t) for t in prompts))
        batch = [prompts] if single else list(prompts)
        ids = [self._encode(p, f"prompts[{i}]" if not single else "prompt") for i, p in enumerate(batch)]
        out = self._complete(ids, Params(**params))
        return out[0] if single else out

    def stream(self, prompt: str | Sequence[int], **params: Any) -> TextStream:
        """generate's text for one prompt as it is made, in pieces that join to it (a character split across
        tokens comes whole in a later piece; text that may begin a stop string is held back until it cannot).
        Closing the stream (or leaving a `for` loop over it with break) aborts the request; once it has ended,
        its `completion` is what generate would have returned. Keywords: `Params`."""
        return TextStream(self, self._submit(self._encode(prompt, "prompt"), _one(Params(**params))))

    def chat(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, **params: Any) -> Completion:
        """The assistant's answer to `messages` ([{"role": "user", "content": "..."}, ...]), as the server's
        /v1/chat/completions gives it: rendered with the checkpoint's chat template (only the template's own
        markup becomes special tokens; chat_template_kwargs are the template's switches, `tools` OpenAI-style
        function specs), stopped at the tokenizer's end-of-sequence tokens and the template's end of turn,
        the reasoning of a layout the server knows (Kimi K3's) in `reasoning` and calls in `tool_calls`.
        Keywords: `Params` (max_tokens defaults to 256; n > 1: a list of n Completion)."""
        prompt = self.chat_prompt(messages, _template_kwargs(chat_template_kwargs, params), tools)
        return self._complete([prompt], _chat_params(params), prompt, tools)[0]

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None, **params: Any) -> TextStream:
        """chat's answer as stream gives text: the pieces are its text; the reasoning gathers in the stream's
        `reasoning`, and the calls in its `completion`."""
        prompt = self.chat_prompt(messages, _template_kwargs(chat_template_kwargs, params), tools)
        return TextStream(self, self._submit(prompt, _one(_chat_params(params)), prompt, tools))

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], chat_template_kwargs: Mapping[str, Any] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The token ids chat sends: the messages rendered with an open assistant turn at the end."""
        listed = [dict(m) if isinstance(m, Mapping) else m for m in messages]  # (the template's checks name a bad one)
        segments = self.tokenizer.chat_segments(listed, tools=None if tools is None else [dict(t) for t in tools],
                                                **dict(chat_template_kwargs or {}))
        return self.tokenizer.encode_segments(segments)

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends what still runs and stops the expert store's reader threads."""
        self._abandon(list(self._jobs.values()))
        self.store.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        if self._scheduler is None:
            from moeswap.engine.scheduler import Scheduler

            self._scheduler = Scheduler(self.model, self.engine)
        return self._scheduler

    def _encode(self, prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, Sequence) or not all(_is_id(t) for t in prompt):
            raise TypeError(f"{where}: expected a string or a list of token ids, got {type(prompt).__name__}")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary 0..{vocab - 1}")
        return list(prompt)

    def _slot(self, adapter) -> int:
        name = self.adapter if adapter is _UNSET else adapter
        if name is None:
            return 0
        if name not in self.adapters:
            served = ", ".join(repr(n) for n in self.adapters) or "none"
            raise ValueError(f"adapter {name!r} is not loaded (adapters: {served}; None is the base model)")
        return self.adapters.index(name) + 1

    def _complete(self, prompts: list[list[int]], params: Params, chat: list[int] | None = None,
                  tools=None) -> list[Any]:
        """Each prompt's Completion (n > 1: its list of n), answer k of the call sampling with seed + k."""
        n = _check_n(params.n)
        jobs: list[_Job] = []
        try:
            for k in range(len(prompts) * n):  # a request the scheduler refuses ends the ones submitted before it
                seed = None if params.seed is None else params.seed + k
                jobs.append(self._submit(prompts[k // n], replace(params, seed=seed), chat, tools))
            while any(job.finish_reason is None for job in jobs):
                self._step()
        finally:
            self._abandon(jobs)
        for job in jobs:
            self._raise(job)
        done = [_completion(job, job.pending) for job in jobs]
        return done if params.n == 1 else [done[i:i + n] for i in range(0, len(done), n)]

    def _submit(self, ids: list[int], params: Params, chat: list[int] | None = None, tools=None) -> _Job:
        """chat: the prompt of a chat answer (ChatOutput reads where its generation prompt left the turn)."""
        from moeswap.engine.sampling import SamplingParams
        from moeswap.engine.scheduler import Request
        from moeswap.text.reasoning import start_state
        from moeswap.text.structured import response_schema

        stops, tok = params.stops(), self.tokenizer
        stop_ids = tok.stop_ids if chat is None else tok.chat_stop_ids  # a chat answer also ends at its turn's end
        eos = () if params.ignore_eos else stop_ids(self.model.config.eos_token_ids)
        schema = response_schema(params.response_format)
        out: TextOutput | ChatOutput
        layout = state = None
        if chat is None:
            out = TextOutput(tok, stops, params.skip_special_tokens)
        else:  # as the server's chat: tool calls parsed when tools are offered
            layout, fmt = self._chat_formats
            state = None if layout is None else start_state(layout, prompt_tail(tok, chat))
            out = ChatOutput(tok, layout, state, fmt if tools else None, stops, params.skip_special_tokens)
        # (after the reasoning, where the prompt opened a reasoning section)
        constraint = None if schema is None else self._structured.constraint(self._structured.grammar(schema),
                                                                               layout, state)
        request = Request(ids, params.max_tokens, SamplingParams(params.temperature, params.top_k, params.top_p,
                                                                 params.presence_penalty, params.frequency_penalty,
                                                                 params.repetition_penalty),
                          tuple(dict.fromkeys([*params.stop_token_ids, *eos])), params.seed,
                          adapter=self._slot(params.adapter), constraint=constraint)
        rid = self.scheduler.submit(request)  # checks lengths, max_tokens, the seed
        job = self._jobs[rid] = _Job(request, out)
        return job

    @functools.cached_property
    def _structured(self):
        """response_format's constraints (text.structured; the vocabulary is read at the first use)."""
        from moeswap.text.structured import StructuredOutput

        return StructuredOutput(self.tokenizer, self.tokenizer.stop_ids(self.model.config.eos_token_ids),
                                self.model.config.vocab_size)

    @functools.cached_property
    def _chat_formats(self):
        """The checkpoint's assistant-turn layout and tool-call format (None each: not one the server reads)."""
        from moeswap.text.reasoning import find_layout
        from moeswap.text.tool_calls import find_format

        return find_layout(self.tokenizer), find_format(self.tokenizer)

    def _step(self) -> None:
        sched = self.scheduler
        try:
            events = sched.step()
        except BaseException as err:  # Ctrl-C included: this scheduler's state may be half-updated
            self._scheduler = None  # (the server's engine loop does the same)
            failed = RuntimeError(f"the engine step failed: {type(err).__name__}: {err}")
            for running in self._jobs.values():
                if running.finish_reason is None:
                    running.finish_reason, running.error = "error", failed
            self._jobs.clear()
            raise
        for ev in events:
            job = self._jobs.get(ev.id)
            result = None
            if ev.finish_reason is not None:
                result = sched.finished.pop(ev.id, None)
                self._jobs.pop(ev.id, None)
            if job is None or job.finish_reason is not None:
                continue  # ended here already (a stop string, an abort)
            self._feed(job, ev)
            if job.finish_reason == "error":
                job.error = result.error if result is not None and result.error is not None else ev.error

    def _feed(self, job: _Job, ev: TokenEvent) -> None:
        """As the server's: the token that ends a sequence by its id (end of sequence, stop_token_ids) is
        not text; a stop string ends the text at once and the sequence at the next step."""
        if ev.token is not None:
            job.tokens.append(ev.token)
            if ev.finish_reason != "stop" or ev.token not in job.request.stop_ids:  # (a response_format's last is)
                text, stopped = job.out.push(ev.token)
                job.pending += text
                if stopped:
                    job.finish_reason = "stop"
                    self.scheduler.abort(ev.id)
        if ev.finish_reason is not None:
            job.pending += job.out.finish()
            job.finish_reason = "stop" if job.out.stopped and ev.finish_reason == "length" else ev.finish_reason
            if isinstance(job.out, ChatOutput) and job.out.called and job.finish_reason in ("stop", "length"):
                job.finish_reason = "tool_calls"
        if isinstance(job.out, ChatOutput):
            job.reasoning += job.out.take_reasoning()

    def _abandon(self, jobs: Sequence[_Job]) -> None:
        """Ends a call's requests that still run (it stopped early: an error, a closed stream), and when no
        request is left that waits for tokens, takes the step that frees the ended ones' slots."""
        for job in jobs:
            if job.finish_reason is None:
                job.finish_reason = "abort"
                if self._scheduler is not None:
                    self._scheduler.abort(job.request.id)
        if (self._scheduler is not None and self._scheduler.busy
                and all(j.finish_reason is not None for j in self._jobs.values())):
            self._step()  # only ended sequences are left: no prefill, no decode

    def _pieces(self, job: _Job) -> Generator[str, None, None]:
        try:
            while True:
                if job.pending:  # (other calls' steps may have added to it while this one waited)
                    text, job.pending = job.pending, ""
                    yield text
                elif job.finish_reason is not None:
                    break
                else:
                    self._step()
            self._raise(job)
        finally:
            self._abandon([job])

    @staticmethod
    def _raise(job: _Job) -> None:
        if job.finish_reason == "error":
            if isinstance(job.error, BaseException):
                raise job.error
            raise RuntimeError(f"generation failed: {job.error}")


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a whole number of answers >= 1, got {n!r}")
    return n


def _one(params: Params) -> Params:
    """A stream's params: one answer."""
    if _check_n(params.n) != 1:
        raise ValueError(f"n: a stream gives one answer, got n={params.n} (generate and chat give n)")
    return params


def _completion(job: _Job, text: str) -> Completion:
    calls = job.out.tool_calls if isinstance(job.out, ChatOutput) else []
    return Completion(text, job.tokens, job.finish_reason or "abort", list(job.request.prompt), job.reasoning, calls)


def _template_kwargs(kwargs: Mapping[str, Any] | None, params: dict[str, Any]) -> dict[str, Any]:
    """The chat template's variables: the caller's, and the response_format (templates such as K3's tell the
    model to answer in JSON, and the schema)."""
    out = dict(kwargs or {})
    if params.get("response_format") is not None:
        out["response_format"] = params["response_format"]
    return out


def _chat_params(params: dict[str, Any]) -> Params:
    return Params(**{"max_tokens": CHAT_MAX_TOKENS, **params})


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
