"""The HTTP side of `moeswap serve`: FastAPI routes for OpenAI's /v1/chat/completions, /v1/completions and
/v1/models, plus /health and /metrics; request checks, streaming (server-sent events) and error bodies.

Every request is checked here before the engine sees it (model name, types, context length, sampling
values, stop strings, response_format, queue room, API key); a bad one gets OpenAI-style error JSON with a 4xx.
Text, reasoning and tool calls come from text.output, a response_format's token constraint from
text.structured, tokens from server.engine_loop. Entry point: `build_app(model, tokenizer,
ServeOptions)`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moeswap.engine.sampling import SamplingParams
from moeswap.engine.scheduler import EngineConfig, Scheduler, TokenEvent, check_seed
from moeswap.engine.scheduler import Request as EngineRequest  # (fastapi's Request is the HTTP one)
from moeswap.server import protocol as P
from moeswap.server.engine_loop import EngineLoop, Handle, QueueFull
from moeswap.server.metrics import CONTENT_TYPE, ServerMetrics
from moeswap.server.options import ServeOptions
from moeswap.text.output import ChatOutput, TextOutput, prompt_tail
from moeswap.text.reasoning import Layout, find_layout, start_state
from moeswap.text.structured import StructuredOutput, StructuredOutputError, response_schema
from moeswap.text.tokenizer import NORMALIZER_SLACK, PromptTooLong
from moeswap.text.tool_calls import ToolCallFormat, find_format

log = logging.getLogger("moeswap.server")

MAX_BODY_BYTES = 64 << 20  # a request body past this is refused (413) before it is parsed, whatever the context
BODY_OVERHEAD_BYTES = 1 << 20  # a request's fields besides its text (sampling, tools' JSON syntax, logit_bias)


@dataclass
class _Server:
    """What every route reads: built once per app."""

    name: str
    tokenizer: object
    engine: EngineLoop
    metrics: ServerMetrics
    max_context: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    api_key: str | None
    adapters: dict[str, int] = field(default_factory=dict)  # served LoRA adapters: name -> slot (lora.serving)
    tool_format: ToolCallFormat | None = None  # how the checkpoint writes tool calls (None: not parsed)
    layout: Layout | None = None  # how it lays out an assistant turn: reasoning, content (None: all content)
    chat_eos_ids: tuple[int, ...] = ()  # eos_ids and the chat template's end of turn (Tokenizer.chat_stop_ids)
    created: int = field(default_factory=P.now)
    aliases: tuple[str, ...] = ()  # other names clients may give the base model as (ServeOptions.model_aliases)
    body_limit: int = MAX_BODY_BYTES  # body_limit(max_context, the tokenizer's max_token_chars), set by build_app
    _token_text: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    @functools.cached_property
    def structured(self) -> StructuredOutput:
        """response_format's constraints (the vocabulary is read for them at the first such request)."""
        return StructuredOutput(self.tokenizer, self.eos_ids, self.vocab_size)

    def token_text(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes, as logprobs show them."""
        hit = self._token_text.get(token)
        if hit is None:
            tok = self.tokenizer
            text = tok.decode([token])
            raw = tok.token_bytes(token) if tok.byte_level else text.encode("utf-8")
            hit = self._token_text[token] = (text, list(raw))
        return hit


def build_app(model, tokenizer, options: ServeOptions = ServeOptions(), store=None, *,
              scheduler=Scheduler, adapters=None) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it. `scheduler(model, EngineConfig)` makes the
    engine thread's scheduler. adapters: the LoRA adapters loaded on `model` (lora.serving.load_adapters, or
    serve_adapters for none yet with options.allow_runtime_lora), which requests name as `model`."""
    max_context = options.resolve_max_context(model.config.max_position_embeddings)
    metrics = ServerMetrics()
    engine = EngineLoop(model, EngineConfig(max_batch=options.max_batch, max_len=max_context, native=options.native),
                        options.max_queue, metrics, scheduler=scheduler)
    metrics.attach(engine, store)
    srv = _Server(options.model_name, tokenizer, engine, metrics, max_context, model.config.vocab_size,
                  tokenizer.stop_ids(model.config.eos_token_ids), options.api_key,
                  {} if adapters is None else {n: adapters.slot(n) for n in adapters.names},
                  find_format(tokenizer), find_layout(tokenizer))
    srv.body_limit = body_limit(max_context, tokenizer.max_token_chars)
    srv.chat_eos_ids = tokenizer.chat_stop_ids(model.config.eos_token_ids)
    srv.aliases = tuple(a for a in options.model_aliases if a != options.model_name)
    if options.model_name in srv.adapters:
        raise ValueError(f"the adapter name {options.model_name!r} is the served model's name; give it another")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="moeswap", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.server = srv
    _errors(app)
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(P.error_body("the engine thread is not running", "server_error"), 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(dependencies=[Depends(_authorize)])

    def card(name: str) -> dict:
        parent = None if name == srv.name else srv.name  # vLLM's form: an adapter's parent is the base model
        return P.model_card(name, srv.created, srv.max_context, parent)

    @v1.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(n) for n in (srv.name, *srv.adapters)]}

    @v1.get("/v1/models/{name:path}")
    async def model_card(name: str):
        return card(_check_model(srv, name)[0])

    @v1.post("/v1/chat/completions")
    async def chat(request: Request):
        req = P.parse_body(P.ChatCompletionRequest, await _body(request))
        served = _check_model(srv, req.model)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = None if req.tools is None else [t.model_dump(exclude_none=True) for t in req.tools]
        if tools is not None and tokenizer.chat_template is None:
            raise P.APIError(400, "'tools' need the checkpoint's chat template (chat_template.jinja or "
                                  "tokenizer_config.json's chat_template), and this model has none", param="tools")
        try:
            segments = tokenizer.chat_segments(messages, tools=tools, **_template_variables(req))
        except ValueError as e:  # the template's own errors (its raise_exception, a reserved variable)
            raise P.APIError(400, str(e), param=None if req.chat_template_kwargs else "messages") from None
        _check_length(srv, sum(len(text) for text, _ in segments), "messages")
        prompt = tokenizer.encode_segments(segments)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if req.top_logprobs is not None and not req.logprobs:
            raise P.APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = _check_top(req.top_logprobs or 0, "top_logprobs") if req.logprobs else None
        # tool calls are parsed when the request offers tools and does not rule them out (OpenAI's "auto")
        tool_format = srv.tool_format if tools and req.tool_choice != "none" else None
        # the generation prompt may have opened the turn's reasoning (K3 with thinking on) or its response
        # (a response_format then shapes the answer once its reasoning has ended)
        state = None if srv.layout is None else start_state(srv.layout, prompt_tail(tokenizer, prompt))
        return await _generate(srv, request, req, served, prompt, max_tokens, param, logprobs, chat=True,
                               tool_format=tool_format, state=state)

    @v1.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse_body(P.CompletionRequest, await _body(request))
        served = _check_model(srv, req.model)
        prompt = _completion_prompt(srv, req.prompt)
        logprobs = None if req.logprobs is None else _check_top(req.logprobs, "logprobs")
        return await _generate(srv, request, req, served, prompt, req.max_tokens, "max_tokens", logprobs, chat=False)

    if options.allow_runtime_lora:  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
        if adapters is None:
            raise ValueError("allow_runtime_lora needs the model's served adapters (lora.serving.serve_adapters)")
        from moeswap.server.runtime_lora import add_routes

        add_routes(v1, srv, adapters, options.max_loras)
    app.include_router(v1)
    return app


# ----------------------------------------------------------------------------------------------------
# Checks


async def _authorize(request: Request) -> None:
    key = request.app.state.server.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        what = "no API key was given" if not given else "the API key is not valid"
        raise P.APIError(401, f"{what}: send the server's --api-key as 'Authorization: Bearer KEY'",
                         code="invalid_api_key")


def body_limit(max_context: int, max_token_chars: int) -> int:
    """The largest request body worth reading: the text of a full context written as JSON at its widest
    (a \\uXXXX escape per character, the tokenizer's normalizer allowed for), plus room for the other
    fields; never more than MAX_BODY_BYTES."""
    return min(MAX_BODY_BYTES, max_context * max_token_chars * NORMALIZER_SLACK * 6 + BODY_OVERHEAD_BYTES)


async def _body(request: Request) -> bytes:
    srv = request.app.state.server
    return await read_body(request, srv.body_limit, f"it follows from the {srv.max_context}-token context")


async def read_body(request: Request, limit: int, why: str) -> bytes:
    """The request's body, read no further than `limit` bytes: 413 (`why` says where the limit comes from) when
    its Content-Length says more, or once the stream passes it."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise P.APIError(413, f"the request body is {int(size)} bytes, more than the limit of {limit} ({why})",
                         code="body_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise P.APIError(413, f"the request body is more than the limit of {limit} bytes ({why})",
                             code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _template_variables(req: P.ChatCompletionRequest) -> dict:
    """What the chat template gets besides messages and tools: `tool_choice` (templates such as K3's tell
    the model what it may do) and the caller's `chat_template_kwargs`, which may not say it differently."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.tool_choice is not None:
        if "tool_choice" in kwargs and kwargs["tool_choice"] != req.tool_choice:
            raise P.APIError(400, f"'chat_template_kwargs.tool_choice' ({json.dumps(kwargs['tool_choice'])}) differs "
                                  f"from 'tool_choice' ({json.dumps(req.tool_choice)}); give it once",
                             param="chat_template_kwargs")
        kwargs["tool_choice"] = req.tool_choice
    if req.response_format is not None:  # templates such as K3's tell the model to answer in JSON (and the schema)
        if "response_format" in kwargs and kwargs["response_format"] != req.response_format:
            raise P.APIError(400, "'chat_template_kwargs.response_format' differs from 'response_format'; give it once",
                             param="chat_template_kwargs")
        kwargs["response_format"] = req.response_format
    return kwargs


def _check_model(srv: _Server, name: str | None) -> tuple[str, int]:
    """(the served model's name, its adapter slot: 0 for the base model) for a request's `model`; 404 for a
    name not served. No name: the base model."""
    if name is None or name == srv.name or name in srv.aliases:
        return srv.name, 0
    slot = srv.adapters.get(name)
    if slot is None:
        served = ", ".join(f"'{n}'" for n in (srv.name, *srv.adapters))
        raise P.APIError(404, f"the model '{name}' does not exist; this server serves {served}", param="model",
                         code="model_not_found")
    return name, slot


def _check_length(srv: _Server, chars: int, param: str) -> None:
    """A prompt text that certainly overflows the context is refused before it is tokenized."""
    try:
        srv.tokenizer.check_length(chars, srv.max_context)
    except PromptTooLong as e:
        raise P.APIError(400, f"{e}; shorten it", param=param, code="context_length_exceeded") from None


def _check_top(k: int, param: str) -> int:
    if not 0 <= k <= P.MAX_TOP_LOGPROBS:
        raise P.APIError(400, f"'{param}' must be between 0 and {P.MAX_TOP_LOGPROBS}, got {k}", param=param)
    return k


def _completion_prompt(srv: _Server, prompt) -> list[int]:
    """A single prompt: a string, or token ids (also each wrapped in a one-element list)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise P.APIError(400, f"'prompt' holds {len(prompt)} prompts; this server takes one per request",
                             param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_length(srv, len(prompt), "prompt")
        return srv.tokenizer.encode(prompt)
    bad = next((i for i, t in enumerate(prompt) if not 0 <= t < srv.vocab_size), None)
    if bad is not None:
        raise P.APIError(400, f"'prompt[{bad}]': token id {prompt[bad]} is outside the vocabulary "
                              f"0..{srv.vocab_size - 1}", param="prompt")
    return list(prompt)


def _sampling(req: P.GenerationFields) -> SamplingParams:
    """SamplingParams (which owns the checks); a refused value is named by its parameter."""
    values = {"temperature": req.temperature, "top_k": 0 if req.top_k == -1 else req.top_k,  # -1: off (vLLM)
              "top_p": req.top_p, "presence_penalty": req.presence_penalty,
              "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty}
    try:
        return SamplingParams(**values)
    except ValueError as e:
        for param, value in values.items():
            try:
                SamplingParams(**{param: value})
            except ValueError:
                raise P.APIError(400, str(e), param=param) from None  # its message names the parameter
        raise P.APIError(400, str(e)) from None


def _gen_requests(srv: _Server, req: P.GenerationFields, prompt: list[int], max_tokens: int | None, param: str,
                  logprobs: int | None, adapter: int = 0, state: str | None = None
                  ) -> tuple[list[EngineRequest], list[str]]:
    """The engine's request for each of the `n` choices, and the stop strings; APIError (4xx) for anything the
    engine could not take. Choice i samples with seed + i (each choice is what a request with that seed gives).
    state: where a chat prompt left the turn (a response_format applies after reasoning there)."""
    if not 1 <= req.n <= srv.engine.capacity:
        raise P.APIError(400, f"'n' must be between 1 and {srv.engine.capacity} (the sequences this server holds "
                              f"at once: --max-batch + --max-queue), got {req.n}", param="n")
    if not prompt:
        raise P.APIError(400, "the prompt is empty: give at least one token", param="prompt")
    room = srv.max_context - len(prompt)
    if max_tokens is not None and max_tokens < 1:
        raise P.APIError(400, f"'{param}' must be at least 1, got {max_tokens}", param=param)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = f"{len(prompt)} in the prompt + " + (f"{max_tokens} to generate" if max_tokens is not None else
                                                     "at least 1 to generate")
        where = "messages" if isinstance(req, P.ChatCompletionRequest) else "prompt"
        raise P.APIError(400, f"this model's context is {srv.max_context} tokens, but {asked} were asked for; "
                              f"shorten the prompt or lower '{param}'", param=param if room >= 1 else where,
                         code="context_length_exceeded")
    sampling = _sampling(req)
    if req.seed is not None:
        try:
            check_seed(req.seed)
            check_seed(req.seed + req.n - 1)
        except ValueError as e:
            raise P.APIError(400, str(e), param="seed") from None  # "seed must be ..."
    stop = _stops(req.stop)
    ids = list(req.stop_token_ids or ())
    bad = next((t for t in ids if not 0 <= t < srv.vocab_size), None)
    if bad is not None:
        raise P.APIError(400, f"'stop_token_ids': {bad} is outside the vocabulary 0..{srv.vocab_size - 1}",
                         param="stop_token_ids")
    eos = srv.chat_eos_ids if isinstance(req, P.ChatCompletionRequest) else srv.eos_ids
    stop_ids = tuple(dict.fromkeys(ids + ([] if req.ignore_eos else list(eos))))
    constraints = _constraints(srv, req, state)
    return [EngineRequest(prompt, room if max_tokens is None else max_tokens, sampling, stop_ids,
                          None if req.seed is None else req.seed + i, logprobs=logprobs, adapter=adapter,
                          constraint=constraint) for i, constraint in enumerate(constraints)], stop


def _constraints(srv: _Server, req: P.GenerationFields, state: str | None) -> list:
    """Each of the `n` choices' token constraint for the request's response_format (None each: free text): one
    grammar, compiled once, and a constraint of its own per choice (they are stateful), followed after the
    reasoning where `state` is reasoning. A schema that is not valid or not followable is a 400."""
    try:
        schema = response_schema(req.response_format)
        if schema is None:
            return [None] * req.n
        grammar = srv.structured.grammar(schema)
        return [srv.structured.constraint(grammar, srv.layout, state) for _ in range(req.n)]
    except StructuredOutputError as e:
        raise P.APIError(400, str(e), param=e.param, code=e.code) from None


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if any(s == "" for s in stops):
        raise P.APIError(400, "'stop': an empty string would stop before any text; leave it out", param="stop")
    return stops


# ----------------------------------------------------------------------------------------------------
# Generation


@dataclass
class _Piece:
    """What arrived for a request since the last piece: text, logprobs of its tokens, and the end, if it came."""

    text: str = ""
    logprobs: list[TokenEvent] = field(default_factory=list)
    reasoning: str = ""  # chat: the reasoning that arrived
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's stream deltas
    finish_reason: str | None = None
    error: str | None = None


async def _pieces(srv: _Server, handle: Handle, out: TextOutput | ChatOutput, token_ids: list[int],
                  stop_ids: frozenset[int]) -> AsyncIterator[_Piece]:
    """The request's output as it comes. A stop string ends it at once: the engine is told to drop the
    sequence (it is freed at the next step) and what it still sends is not read. An answer that called tools
    ends with finish reason "tool_calls". stop_ids: the request's (its token that ended it by its id is not
    text; one that completed its response_format is)."""
    async for batch in handle.batches():
        piece = _Piece()
        for item in batch:
            if item.token is not None:
                token_ids.append(item.token)
                # the token that ends a sequence by its id (eos, stop_token_ids) is not text
                if item.finish_reason != "stop" or item.token not in stop_ids:
                    text, stopped = out.push(item.token)
                    piece.text += text
                    if item.logprob is not None:
                        piece.logprobs.append(item)
                    if stopped:
                        piece.finish_reason = "stop"
                        srv.engine.abort(handle)
                        handle.done = True
                        break
            if item.finish_reason is not None:
                piece.finish_reason, piece.error = item.finish_reason, item.error
        if piece.finish_reason is not None and not out.stopped:
            piece.text += out.finish()
            if out.stopped and piece.finish_reason == "length":  # in the text of calls that broke off
                piece.finish_reason = "stop"
        if isinstance(out, ChatOutput):
            piece.reasoning = out.take_reasoning()
            piece.tool_calls = out.take_deltas()
            if out.called and piece.finish_reason in ("stop", "length"):
                piece.finish_reason = "tool_calls"
        if piece.finish_reason is not None:
            srv.metrics.requests_finished.labels(piece.finish_reason).inc()  # before the client can see it
        yield piece


@dataclass
class _Choice:
    """One of a request's `n` choices: its engine handle, its text output and the token ids it has given."""

    handle: Handle
    out: TextOutput | ChatOutput
    stop_ids: frozenset[int]  # the request's: its token that ended it by its id is not text
    ids: list[int] = field(default_factory=list)


async def _generate(srv: _Server, request: Request, req: P.GenerationFields, served: tuple[str, int],
                    prompt: list[int], max_tokens: int | None, param: str, logprobs: int | None, chat: bool,
                    tool_format: ToolCallFormat | None = None, state: str | None = None):
    """served: the model's name as the request gave it (the base model or an adapter) and its adapter slot."""
    model_name, adapter = served
    args = (srv, req, prompt, max_tokens, param, logprobs, adapter, state)
    # a response_format's schema compiles (and the first one reads the vocabulary: ~0.5 s at 160k tokens) off
    # the event loop, which goes on streaming the other requests' tokens meanwhile
    if req.response_format is None:
        gens, stops = _gen_requests(*args)
    else:
        gens, stops = await asyncio.to_thread(_gen_requests, *args)
    choices: list[_Choice] = []
    try:
        for gen in gens:
            if chat:
                out: TextOutput | ChatOutput = ChatOutput(srv.tokenizer, srv.layout, state, tool_format, stops,
                                                          skip_specials=req.skip_special_tokens,
                                                          parallel=req.parallel_tool_calls is not False)
            else:
                out = TextOutput(srv.tokenizer, stops, skip_specials=req.skip_special_tokens)
            choices.append(_Choice(srv.engine.submit(gen), out, frozenset(gen.stop_ids)))
    except QueueFull as e:
        for c in choices:  # all of a request's choices run, or none
            srv.engine.abort(c.handle)
        raise P.APIError(429, f"the server is busy: {e}", type="rate_limit_exceeded",
                         code="rate_limit_exceeded") from None
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(srv, choices, rid, req, prompt, chat, include_usage, model_name),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(_abort_on_disconnect(request, srv.engine, [c.handle for c in choices]))
    try:
        answers = await asyncio.gather(*(_collect(srv, c) for c in choices))
    finally:
        watcher.cancel()
        for c in choices:
            srv.engine.abort(c.handle)  # nothing if it ended; frees the sequence if this handler was cancelled
    failed = next((error for _, _, finish, error in answers if finish == "error"), None)
    if failed is not None:
        raise P.APIError(500, f"generation failed: {failed}", code="generation_failed")
    body_choices = []
    for i, (c, (text, lps, finish, _)) in enumerate(zip(choices, answers)):
        choice: dict = {"index": i}
        if chat:
            choice["message"] = _message(text, c.out)
            choice["logprobs"] = None if logprobs is None else {"content": _chat_logprobs(srv, lps)}
        else:
            choice["text"] = text
            choice["logprobs"] = None if logprobs is None else _completion_logprobs(srv, lps)
        choice["finish_reason"] = finish
        if req.return_token_ids:
            choice["token_ids"] = c.ids
        body_choices.append(choice)
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": P.now(),
            "model": model_name, "choices": body_choices,
            "usage": P.usage(len(prompt), sum(len(c.ids) for c in choices))}
    if req.return_token_ids:  # vLLM's: the prompt's ids on top (chat) or in each choice (completions)
        for choice in [body] if chat else body_choices:
            choice["prompt_token_ids"] = prompt
    return JSONResponse(body)


async def _collect(srv: _Server, c: _Choice) -> tuple[str, list[TokenEvent], str | None, str | None]:
    """A choice's whole answer: (text, logprobs, finish reason, error)."""
    text, lps, finish, error = "", [], None, None
    try:
        async for piece in _pieces(srv, c.handle, c.out, c.ids, c.stop_ids):
            text += piece.text
            lps += piece.logprobs
            finish, error = piece.finish_reason, piece.error
    finally:
        if finish is None:
            srv.metrics.requests_finished.labels("abort").inc()
    return text, lps, finish, error


def _message(content: str, out: ChatOutput) -> dict:
    """The answer's message. Reasoning under both names clients read (vLLM's `reasoning_content`, and
    `reasoning`, which newer vLLM and OpenAI's guidance use); content null when reasoning or calls came
    without any, as vLLM gives it."""
    message: dict = {"role": "assistant", "content": content}
    if out.reasoning:
        message["reasoning_content"] = message["reasoning"] = out.reasoning
    if out.called:
        message["tool_calls"] = out.tool_calls
    if not content and (out.reasoning or out.called):
        message["content"] = None
    return message


async def _stream(srv: _Server, choices: list[_Choice], rid: str, req: P.GenerationFields, prompt: list[int],
                  chat: bool, include_usage: bool, model_name: str) -> AsyncIterator[str]:
    """Server-sent events of every choice as its pieces come (each chunk names its choice's index)."""
    created = P.now()
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(index: int | None, choice: dict | None = None, **extra) -> str:
        body = {"id": rid, "object": kind, "created": created, "model": model_name,
                "choices": [] if choice is None else [{"index": index, **choice}], **extra}
        if include_usage:
            body.setdefault("usage", None)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    queue: asyncio.Queue[tuple[int, _Piece | None]] = asyncio.Queue()

    async def feed(i: int, c: _Choice) -> None:
        try:
            async for piece in _pieces(srv, c.handle, c.out, c.ids, c.stop_ids):
                await queue.put((i, piece))
        finally:
            await queue.put((i, None))

    finished: dict[int, str] = {}
    tasks = [asyncio.create_task(feed(i, c)) for i, c in enumerate(choices)]
    try:
        if chat:
            for i in range(len(choices)):
                yield chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        open_choices = len(choices)
        while open_choices:
            i, piece = await queue.get()
            if piece is None:
                open_choices -= 1
                continue
            if piece.finish_reason is not None:
                finished[i] = piece.finish_reason
            if piece.finish_reason == "error":
                yield f"data: {json.dumps(P.error_body(f'generation failed: {piece.error}', 'server_error'))}\n\n"
                break
            if not (piece.text or piece.reasoning or piece.logprobs or piece.tool_calls or piece.finish_reason):
                continue  # held back (a possible stop string, an unfinished character, a possible tool call)
            choice: dict = {}
            if chat:
                choice["delta"] = {}
                if piece.reasoning:
                    choice["delta"]["reasoning_content"] = choice["delta"]["reasoning"] = piece.reasoning
                if piece.text:
                    choice["delta"]["content"] = piece.text
                if piece.tool_calls:
                    choice["delta"]["tool_calls"] = piece.tool_calls
                choice["logprobs"] = {"content": _chat_logprobs(srv, piece.logprobs)} if piece.logprobs else None
            else:
                choice["text"] = piece.text
                choice["logprobs"] = _completion_logprobs(srv, piece.logprobs) if piece.logprobs else None
            choice["finish_reason"] = piece.finish_reason
            if req.return_token_ids and piece.finish_reason is not None:
                choice["token_ids"] = choices[i].ids
            yield chunk(i, choice)
        if include_usage:
            yield chunk(None, usage=P.usage(len(prompt), sum(len(c.ids) for c in choices)))
        yield "data: [DONE]\n\n"
    finally:
        # the client left (the response task was cancelled), a choice failed, or the stream ended: free them all
        for t in tasks:
            t.cancel()
        for i, c in enumerate(choices):
            if i not in finished:
                srv.metrics.requests_finished.labels("abort").inc()
            srv.engine.abort(c.handle)


async def _abort_on_disconnect(request: Request, engine: EngineLoop, handles: list[Handle]) -> None:
    """A client that goes away while its (non-streamed) answer is made frees its sequences at the next step."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for handle in handles:
                engine.abort(handle)
            return


def _chat_logprobs(srv: _Server, items: list[TokenEvent]) -> list[dict]:
    def entry(token: int, lp: float) -> dict:
        text, raw = srv.token_text(token)
        return {"token": text, "logprob": lp, "bytes": raw}

    return [{**entry(it.token, it.logprob), "top_logprobs": [entry(t, lp) for t, lp in it.top_logprobs or ()]}
            for it in items]


def _completion_logprobs(srv: _Server, items: list[TokenEvent]) -> dict:
    tokens = [srv.token_text(it.token)[0] for it in items]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [it.logprob for it in items],
            "top_logprobs": [{srv.token_text(t)[0]: lp for t, lp in it.top_logprobs or ()} for it in items],
            "text_offset": offsets}


# ----------------------------------------------------------------------------------------------------
# Errors and request counts


def _errors(app: FastAPI) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(request: Request, exc: P.APIError):
        return JSONResponse(exc.body(), exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(P.error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                         "invalid_request_error"), exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)


_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class _CountRequests:
    """Counts responses by endpoint and status (a pure ASGI middleware: it leaves streaming and disconnect
    handling as they are)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "/v1/models" if path.startswith("/v1/models/") else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
