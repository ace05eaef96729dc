"""The HTTP client of `bench serve`: streamed `/v1/completions` requests (TTFT, ITL, usage), one load level
at a fixed concurrency or with Poisson arrivals, and the preparation of a target (its model, token-id
prompts or words, warm-up). Entry points: `prepare`, `run_level`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from moeswap.bench.serve.servers import Target
from moeswap.bench.serve.workload import Level, Prompts, Spec, Workload


@dataclass
class Outcome:
    """One request as its client saw it; times in seconds from its send (start_s: from the level's start)."""

    index: int
    max_tokens: int
    start_s: float = 0.0
    end_s: float = 0.0  # when it ended, answered or failed (from the level's start)
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    chunks: int = 0  # chunks with text
    token_ids: list[int] | None = None  # moeswap's return_token_ids
    prompt: list[int] | str | None = None

    @property
    def tpot_s(self) -> float | None:
        """(end-to-end - first token) / (tokens after the first), as vLLM's benchmark defines it."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
        return {"index": self.index, "ok": self.ok, "error": self.error, "start_ms": ms(self.start_s),
                "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s), "e2e_ms": ms(self.e2e_s),
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "max_tokens": self.max_tokens, "chunks": self.chunks}


def payload(target: Target, spec: Spec, return_ids: bool = False) -> dict:
    body = {"model": target.model, "prompt": spec.ids if target.token_prompts and spec.ids else spec.text,
            "max_tokens": spec.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if return_ids:
        body["return_token_ids"] = True  # moeswap's (vLLM's) extension: the generated ids in the last chunk
    return body


def error_message(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, KeyError, TypeError):
        msg = raw.decode("utf-8", "replace").strip()[:300]
    return f"HTTP {status}: {msg}"


async def send(client, target: Target, spec: Spec, headers: dict, return_ids: bool, t_level: float) -> Outcome:
    """One streamed completion. TTFT: to the first chunk with text (the first chunk of any kind when none has
    text); ITL: between chunks with text; output tokens: the server's usage (else the ids, else the chunks)."""
    body = payload(target, spec, return_ids)
    out = Outcome(spec.index, body["max_tokens"], prompt=body["prompt"])
    t0 = time.perf_counter()
    out.start_s = t0 - t_level
    try:
        await _stream(client, target, body, headers, out, t0)
    finally:
        out.end_s = time.perf_counter() - t_level
    return out


async def _stream(client, target: Target, body: dict, headers: dict, out: Outcome, t0: float) -> None:
    import httpx

    first_any = last = None
    usage = None
    done = False
    try:
        async with client.stream("POST", target.url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = error_message(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    out.error = "stream error: " + str(err.get("message", err) if isinstance(err, dict) else err)
                    return
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                first_any = first_any or now
                c = choices[0]
                if c.get("token_ids") is not None:
                    out.token_ids = list(c["token_ids"])
                if c.get("text"):
                    if out.ttft_s is None:
                        out.ttft_s = now - t0
                    else:
                        out.itl_s.append(now - last)
                    last = now
                    out.chunks += 1
    except (httpx.HTTPError, OSError, ValueError) as err:  # connection lost, timeout, a malformed chunk
        out.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return
    end = time.perf_counter()
    if not done:
        out.error = "the stream ended without [DONE]"
        return
    if out.ttft_s is None and first_any is not None:
        out.ttft_s = first_any - t0
    out.e2e_s = end - t0
    if usage:
        out.prompt_tokens, out.output_tokens = usage.get("prompt_tokens"), int(usage.get("completion_tokens") or 0)
    else:
        out.output_tokens = len(out.token_ids) if out.token_ids is not None else out.chunks
    out.ok = out.ttft_s is not None
    if not out.ok:
        out.error = "no completion chunk in the stream"


def _client(timeout_s: float, api_key: str | None):
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
    return client, headers


async def run_level(target: Target, prompts: Prompts, w: Workload, level: Level, api_key: str | None,
                     stream: str = "run", count: int | None = None) -> tuple[list[Outcome], float]:
    """Requests 0, 1, ... of `stream` at `level` until the count or the duration is reached; every request sent
    is waited for. Returns the outcomes (in send order) and the duration from the first send to the last end."""
    count = w.num_requests if count is None else count
    client, headers = _client(w.timeout_s, api_key)
    outcomes: list[Outcome] = []
    t_level = time.perf_counter()
    deadline = None if w.duration_s is None or stream != "run" else t_level + w.duration_s
    next_index = 0

    def take() -> Spec | None:
        nonlocal next_index
        if (count is not None and next_index >= count) or (deadline and time.perf_counter() >= deadline):
            return None
        next_index += 1
        return prompts.spec(next_index - 1, stream)

    async def one(spec: Spec) -> None:
        outcomes.append(await send(client, target, spec, headers, target.moeswap, t_level))

    async with client:
        if level.concurrency:
            async def worker() -> None:
                while (spec := take()) is not None:
                    await one(spec)

            await asyncio.gather(*(worker() for _ in range(level.concurrency)))
        else:
            rng = random.Random(f"{w.seed}/{stream}/arrivals")
            tasks = []
            while (spec := take()) is not None:
                tasks.append(asyncio.create_task(one(spec)))
                await asyncio.sleep(rng.expovariate(level.rate))
            await asyncio.gather(*tasks)
    # the first send is at 0: the run lasts until its last request ended (not a Poisson wait after it)
    return sorted(outcomes, key=lambda o: o.index), max((o.end_s for o in outcomes), default=0.0)


def _model_card(target: Target, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(target.url + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as err:
        raise RuntimeError(f"{target.name}: GET /v1/models: {type(err).__name__}: {err}") from None
    if r.status_code != 200:
        raise RuntimeError(f"{target.name}: GET /v1/models: {error_message(r.status_code, r.content)}")
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{target.name}: GET /v1/models lists no model")
    return data[0]


def prepare(target: Target, prompts: Prompts, w: Workload, api_key: str | None) -> None:
    """The model to name, whether the server takes token-id prompts (one short probe request), whether the
    longest request fits its context; then the warm-up."""
    card = _model_card(target, api_key)
    target.model = card["id"]
    if card.get("owned_by") == "moeswap" and target.kind == "server":
        target.kind = "moeswap"
    limit = card.get("max_model_len")
    if limit and prompts.pool and w.prompt.hi + w.output.hi > limit:
        raise ValueError(f"{target.name}: prompts of up to {w.prompt.hi} tokens + {w.output.hi} output tokens do "
                         f"not fit its context of {limit} tokens")
    target.token_prompts = bool(prompts.pool)
    if prompts.pool:
        probe = prompts.spec(0, "probe")
        got = asyncio.run(_probe(target, Spec(0, 1, probe.ids[:4], probe.text), w, api_key))
        if not got.ok and got.error and got.error.startswith(("HTTP 400", "HTTP 422")):
            target.token_prompts = False
            target.about["token_prompts_refused"] = got.error
        elif not got.ok:
            raise RuntimeError(f"{target.name}: a probe request failed: {got.error}")
    target.about["prompts"] = "token ids" if target.token_prompts else "words"
    if w.warmup:
        outs, _ = asyncio.run(run_level(target, prompts, w, Level(concurrency=w.warmup), api_key, "warmup",
                                         w.warmup))
        bad = [o for o in outs if not o.ok]
        target.about["warmup"] = {"requests": len(outs), "failed": len(bad)}
        if bad:
            target.about["warmup"]["first_error"] = bad[0].error
    if target.rss:
        target.rss.mark("after_warmup")


async def _probe(target: Target, spec: Spec, w: Workload, api_key: str | None) -> Outcome:
    client, headers = _client(w.timeout_s, api_key)
    async with client:
        return await send(client, target, spec, headers, False, time.perf_counter())
