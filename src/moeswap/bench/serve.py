"""`moeswap bench serve`: load on an OpenAI-compatible server, in the style of vLLM's benchmark_serving and
SGLang's bench_serving. Streamed `/v1/completions` requests at a fixed concurrency or with Poisson arrivals,
random prompts (token ids, else words) and output lengths (max_tokens with ignore_eos), greedy; per request
time to first token, time per output token and inter-token latencies (between chunks with text); p50/p90/p99,
request and output-token throughput, failures, and the server's RSS through the run.

The target is `--url` or a `moeswap serve` it launches (`--launch MODEL`); peers (`--peers`) are launched
beside it on their own loopback ports and measured round-robin with it: `moeswap-batch1` (moeswap serve
--max-batch 1) and `llama-server` (peers/llamaserver.py). Entry points: `add_parser(benches)`, `run(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moeswap.options import LoadOptions, add_load_flags
from moeswap.procfs import cpu_model, rss_bytes

PEERS = ("moeswap-batch1", "llama-server")
MAX_ERRORS = 5  # distinct error messages kept per target and load
MIB = 1 << 20

# Prompts of random words, for servers that refuse token ids: common English words, each one token (with its
# leading space) in most BPE vocabularies, so a prompt of n words is about n tokens; usage says how many.
WORDS = tuple("""the of and to in is was for on that with as by at from his her it an were are which this be or
has had not but one their first new two after who they its have also been time other more into up over year
city state world people work school house water place right part number group family system power line music
game small large long high early great local light name life river music point study story""".split())


# ----------------------------------------------------------------------------------------------------
# The workload


@dataclass(frozen=True)
class Lengths:
    """A token count: fixed (lo == hi) or uniform over lo..hi inclusive."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, flag: str) -> Lengths:
        try:
            lo, _, hi = text.partition(":")
            r = cls(int(lo), int(hi or lo))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected a count N or a range LO:HI, e.g. 128 or 64:256") from None
        if r.lo < 1 or r.hi < r.lo:
            raise ValueError(f"{flag} {text!r}: expected 1 <= LO <= HI")
        return r

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}..{self.hi} (uniform)"


@dataclass(frozen=True)
class Workload:
    prompt: Lengths
    output: Lengths
    num_requests: int | None  # per load level; None: as many as --duration allows
    duration_s: float | None  # per load level: no request is sent after it
    warmup: int  # requests per target before the first level, not measured
    seed: int = 0
    timeout_s: float = 600.0  # per request


@dataclass(frozen=True)
class Level:
    """One load: `concurrency` requests always in flight, or Poisson arrivals at `rate` per second."""

    concurrency: int | None = None
    rate: float | None = None

    def __str__(self) -> str:
        return f"concurrency {self.concurrency}" if self.concurrency else f"{self.rate:g} req/s (Poisson)"

    def as_dict(self) -> dict:
        return {"concurrency": self.concurrency} if self.concurrency else {"request_rate": self.rate}


@dataclass(frozen=True)
class Spec:
    index: int
    max_tokens: int
    ids: list[int] | None  # token ids, when the vocabulary is known
    text: str  # the same length in words, for servers that take no ids


class Prompts:
    """Request i of a run, the same for every target: its lengths and content come from (seed, i) alone.
    Warm-up requests are drawn from a stream of their own, so the measured ones do not depend on --warmup."""

    def __init__(self, workload: Workload, pool: list[int] | None):
        self.w, self.pool = workload, pool

    def spec(self, i: int, stream: str = "run") -> Spec:
        rng = random.Random(f"{self.w.seed}/{stream}/{i}")
        n, m = self.w.prompt.draw(rng), self.w.output.draw(rng)
        ids = [rng.choice(self.pool) for _ in range(n)] if self.pool else None
        return Spec(i, m, ids, " ".join(rng.choice(WORDS) for _ in range(n)))


def vocabulary(model_dir: str) -> list[int]:
    """The ids a random prompt draws from: the tokenizer's ordinary tokens that the model's embedding has."""
    from moeswap.config import load_config
    from moeswap.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    n = min(tok.vocab_size, load_config(model_dir).vocab_size)
    return [i for i in range(n) if i not in tok.id_to_special]


# ----------------------------------------------------------------------------------------------------
# Servers: launched processes, their RSS, the targets


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler:
    """A server process's resident memory, read from /proc every `interval` seconds in a thread of its own
    (so the event loop's load never delays a reading), with named marks (loaded, after warm-up, end)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.t0 = time.perf_counter()
        self.samples: list[tuple[float, int]] = []
        self.marks: dict[str, tuple[float, int | None]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.read()
            self._stop.wait(self.interval)

    def read(self) -> int | None:
        rss = rss_bytes(self.pid)
        if rss is not None:
            self.samples.append((time.perf_counter() - self.t0, rss))
        return rss

    def mark(self, label: str) -> None:
        self.marks[label] = (time.perf_counter() - self.t0, self.read())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def report(self) -> dict:
        """Bytes at each mark, the peak after warm-up (from its mark on), the growth from warm-up to the end,
        and the samples (seconds since sampling began, MiB; at most ~300 of them)."""
        at = {k: v[1] for k, v in self.marks.items()}
        warm_t = self.marks["after_warmup"][0] if "after_warmup" in self.marks else 0.0
        after = [r for t, r in self.samples if t >= warm_t]
        warm, end = at.get("after_warmup"), at.get("end")
        step = max(1, -(-len(self.samples) // 300))
        return {"pid": self.pid, **{f"{k}_bytes": v for k, v in at.items()},
                "peak_after_warmup_bytes": max(after, default=None),
                "peak_bytes": max((r for _, r in self.samples), default=None),
                "growth_after_warmup_bytes": end - warm if end is not None and warm is not None else None,
                "samples_mib": [[round(t, 2), round(r / MIB, 1)] for t, r in self.samples[::step]]}


class ServerProcess:
    """A server the benchmark started: its output goes to a temporary file (a chatty server never blocks on
    a pipe), whose tail is the error when it fails to start."""

    def __init__(self, name: str, argv: list[str], env: dict, url: str):
        self.name, self.argv, self.url = name, argv, url
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=env)

    def log_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:].strip()

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health answers 200 (llama-server answers 503 while it loads)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} while starting: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer /health within {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Ctrl-C (both servers shut down cleanly on SIGINT), then SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()


@dataclass
class Target:
    name: str
    kind: str  # "moeswap" | "llama-server" | "server" (a --url of another kind)
    url: str
    process: ServerProcess | None = None
    rss: RssSampler | None = None
    model: str | None = None  # the `model` requests name (from /v1/models)
    token_prompts: bool = True
    about: dict = field(default_factory=dict)  # how it runs: command, version, prompts

    @property
    def moeswap(self) -> bool:
        return self.kind == "moeswap"


def moeswap_argv(model: str, port: int, max_batch: int, max_queue: int, load: LoadOptions) -> list[str]:
    return [sys.executable, "-m", "moeswap", "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--max-batch", str(max_batch), "--max-queue", str(max_queue), "--log-level", "warning", *load.to_argv()]


def spawn(name: str, kind: str, argv: Callable[[int], list[str]], env: dict) -> Target:
    """Start a server on a free loopback port (`argv(port)`); `ready` waits for it."""
    port = free_port()
    argv = argv(port)
    url = f"http://127.0.0.1:{port}"
    shown = [Path(a).name if i == 0 else a for i, a in enumerate(argv)]
    return Target(name, kind, url, ServerProcess(name, argv, env, url), about={"command": " ".join(shown)})


def ready(target: Target, timeout_s: float) -> None:
    """Wait until it serves, then sample its RSS from then on."""
    target.process.wait_ready(timeout_s)
    target.rss = RssSampler(target.process.proc.pid)
    target.rss.mark("loaded")


# ----------------------------------------------------------------------------------------------------
# Requests


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


def _error_message(status: int, raw: bytes) -> str:
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
                out.error = _error_message(resp.status_code, await resp.aread())
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


async def _run_level(target: Target, prompts: Prompts, w: Workload, level: Level, api_key: str | None,
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
        raise RuntimeError(f"{target.name}: GET /v1/models: {_error_message(r.status_code, r.content)}")
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
        outs, _ = asyncio.run(_run_level(target, prompts, w, Level(concurrency=w.warmup), api_key, "warmup",
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


# ----------------------------------------------------------------------------------------------------
# Summaries


def percentiles(xs: list[float], scale: float = 1e3) -> dict:
    """mean, p50, p90, p99 (linear interpolation between order statistics, as numpy's default), times
    `scale` (seconds -> ms); None (JSON null) for each when there are no values."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        f = math.floor(k)
        c = min(f + 1, len(s) - 1)
        return (s[f] + (s[c] - s[f]) * (k - f)) * scale

    return {"mean": sum(s) / len(s) * scale, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def summarize(outcomes: list[Outcome], duration_s: float) -> dict:
    done = [o for o in outcomes if o.ok]
    tokens = sum(o.output_tokens for o in done)
    errors: list[str] = []
    for o in outcomes:
        if not o.ok and o.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(o.error)
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    return {"sent": len(outcomes), "completed": len(done), "failed": len(outcomes) - len(done),
            "duration_s": duration_s, "total_output_tokens": tokens,
            "total_prompt_tokens": sum(o.prompt_tokens or 0 for o in done),
            "request_throughput": rate(len(done)), "output_throughput": rate(tokens),
            "ttft_ms": percentiles([o.ttft_s for o in done]),
            "tpot_ms": percentiles([o.tpot_s for o in done if o.tpot_s is not None]),
            "itl_ms": percentiles([x for o in done for x in o.itl_s]),
            "e2e_ms": percentiles([o.e2e_s for o in done]),
            "first_errors": errors, "requests": [o.as_dict() for o in outcomes]}


# ----------------------------------------------------------------------------------------------------
# The greedy check


def check_greedy(model_dir: str, load: LoadOptions, runs: dict[str, list[list[Outcome]]], per_target: int,
                 threads: int | None = None) -> dict:
    """Up to `per_target` completed requests of each moeswap target (spread over its run) against
    `moeswap generate`'s greedy tokens for the same prompt and max_tokens (engine.generate, batch 1), on
    the servers' `threads`: torch's GEMM (prompts over 32 tokens) rounds differently at another thread
    count, and a random model's near-tied logits then pick other tokens (1 vs 2 threads on bench-k3: all
    of 10 prompts differed within 27 tokens; 2 vs 2: none)."""
    import torch

    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.engine.tokenizer import load_tokenizer
    from moeswap.models.loader import load_model

    picked: list[tuple[str, Outcome]] = []
    for name, levels in runs.items():
        done = [o for outs in levels for o in outs if o.ok and o.token_ids is not None]
        step = max(1, len(done) / per_target)
        picked += [(name, done[int(k * step)]) for k in range(min(per_target, len(done)))]
    report: dict = {"checked": len(picked), "equal": 0, "mismatches": []}
    if not picked:
        report["ok"] = False
        report["note"] = "no completed request returned its token ids"
        return report
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    model, store = load_model(model_dir, load)
    tok = load_tokenizer(model_dir)
    reference: dict[tuple, list[int]] = {}
    try:
        for name, o in picked:
            ids = tok.encode(o.prompt) if isinstance(o.prompt, str) else list(o.prompt)
            key = (tuple(ids), o.max_tokens)
            if key not in reference:
                cfg = GenerationConfig(max_tokens=o.max_tokens, stop_ids=())
                reference[key] = generate(model, ids, cfg, engine=EngineConfig(max_batch=1, max_len=len(ids) + o.max_tokens)).tokens
            ref = reference[key]
            if o.token_ids == ref:
                report["equal"] += 1
            elif len(report["mismatches"]) < MAX_ERRORS:
                first = next((i for i, (a, b) in enumerate(zip(o.token_ids, ref)) if a != b),
                             min(len(o.token_ids), len(ref)))
                report["mismatches"].append({"target": name, "request": o.index, "first_difference": first,
                                             "server_tokens": len(o.token_ids), "generate_tokens": len(ref)})
    finally:
        store.close()
        torch.set_num_threads(before)
    report["ok"] = report["equal"] == report["checked"]
    return report


# ----------------------------------------------------------------------------------------------------
# The run


@dataclass
class Setup:
    workload: Workload
    levels: list[Level]
    url: str | None = None  # --url; else `launch` is the model to serve
    launch: str | None = None
    model_dir: str | None = None  # the checkpoint behind the target (--launch, or --model-dir with --url)
    peers: tuple[str, ...] = ()
    threads: int = 2
    max_batch: int = 16
    max_queue: int = 1024
    load: LoadOptions = LoadOptions()
    api_key: str | None = None
    server_pid: int | None = None
    llama_server: str | None = None
    gguf: str | None = None
    check_greedy: int | None = None
    start_timeout_s: float = 600.0


def _spawn_peer(name: str, s: Setup, env: dict) -> Target:
    if name == "moeswap-batch1":
        return spawn(name, "moeswap", lambda port: moeswap_argv(s.model_dir, port, 1, s.max_queue, s.load), env)
    from moeswap.bench.peers import llamacpp, llamaserver

    binary, why = llamaserver.find(s.llama_server)
    if binary is None:
        raise _Skip(why)
    if s.gguf is None and not (llamacpp.converter_dir() / "convert_hf_to_gguf.py").is_file():
        raise _Skip(f"llama.cpp's converter is not in {llamacpp.converter_dir()} (it makes the GGUF); run "
                    "scripts/setup-peers.sh or pass --gguf")
    gguf = s.gguf or str(llamacpp.ensure_gguf(s.model_dir))
    ctx = s.workload.prompt.hi + s.workload.output.hi + 16
    t = spawn(name, "llama-server",
              lambda port: llamaserver.command(binary, gguf, port, s.threads, s.max_batch, ctx), dict(os.environ))
    t.about.update(version=llamaserver.version(binary), gguf=gguf)
    return t


class _Skip(Exception):
    """A peer that cannot run here: the report says why."""


def measure(s: Setup, log=print) -> dict:
    """Start the servers, warm each up, run every load level on each in turn, stop them; then the greedy check."""
    from moeswap.bench.sidebyside import _git_revision

    w = s.workload
    prompts = Prompts(w, vocabulary(s.model_dir) if s.model_dir else None)
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}  # the same threads as llama-server's -t / -tb
    targets: list[Target] = []
    skipped: dict[str, str] = {}
    report: dict = {"bench": "serve", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "machine": {"git": _git_revision(), "cpu": cpu_model(), "cores": os.cpu_count(),
                                "threads": s.threads, "load_average": list(os.getloadavg())}}
    try:
        if s.launch:
            log(f"starting moeswap serve {s.launch} (max batch {s.max_batch})")
            targets.append(spawn("moeswap", "moeswap",
                                 lambda port: moeswap_argv(s.launch, port, s.max_batch, s.max_queue, s.load), env))
        else:
            targets.append(Target(s.url, "server", s.url.rstrip("/")))
            if s.server_pid:
                targets[0].rss = RssSampler(s.server_pid)
                targets[0].rss.mark("loaded")
        for name in s.peers:  # all servers load at once
            if not s.model_dir:
                skipped[name] = "needs the checkpoint: give --launch MODEL, or --model-dir with --url"
                continue
            log(f"starting {name}")
            try:
                targets.append(_spawn_peer(name, s, env))
            except _Skip as why:
                skipped[name] = str(why)
            except RuntimeError as err:  # the GGUF conversion failed
                skipped[name] = str(err)[-600:]
        for i, t in enumerate(list(targets)):
            try:
                if t.process:
                    ready(t, s.start_timeout_s)
                    log(f"{t.name}: ready")
                log(f"{t.name}: warm-up ({w.warmup} requests)")
                prepare(t, prompts, w, s.api_key)
            except RuntimeError as err:
                if i == 0:  # the target itself: nothing to measure (one line, not a traceback)
                    raise ValueError(str(err)) from None
                skipped[t.name] = f"could not start: {str(err)[-600:]}"
                targets.remove(t)
                _stop(t)
        runs: dict[str, list[list[Outcome]]] = {t.name: [] for t in targets}
        rows = []
        for level in s.levels:
            row = {**level.as_dict(), "results": {}}
            for t in targets:  # round-robin: load from other users of the machine hits all of them alike
                log(f"{t.name}: {level}")
                cpu = time.process_time()
                outcomes, duration = asyncio.run(_run_level(t, prompts, w, level, s.api_key))
                runs[t.name].append(outcomes)
                r = row["results"][t.name] = summarize(outcomes, duration)
                # what else ran: this client's own CPU time, and the machine's load when the level ended
                r["client_cpu_s"], r["load_average_end"] = time.process_time() - cpu, os.getloadavg()[0]
                log(f"  {r['completed']}/{r['sent']} done in {duration:.1f} s: {_fmt(r['output_throughput'])} "
                    f"output tok/s, TTFT p99 {_fmt(r['ttft_ms']['p99'])} ms")
            main = row["results"][targets[0].name]
            row["ratios"] = {t.name: _ratios(main, row["results"][t.name]) for t in targets[1:]}
            rows.append(row)
        for t in targets:
            if t.rss:
                t.rss.mark("end")
        report.update({
            "target": targets[0].name, "url": s.url, "launch": s.launch, "model_dir": s.model_dir,
            "workload": {"prompt_tokens": [w.prompt.lo, w.prompt.hi], "output_tokens": [w.output.lo, w.output.hi],
                         "num_requests": w.num_requests, "duration_s": w.duration_s, "warmup": w.warmup,
                         "seed": w.seed, "temperature": 0, "ignore_eos": True, "stream": True},
            "settings": {"max_batch": s.max_batch, "max_queue": s.max_queue, "threads": s.threads,
                         "load": s.load.to_argv()},
            "servers": {t.name: {"kind": t.kind, "url": t.url, "model": t.model, **t.about} for t in targets},
            "skipped": skipped, "rows": rows,
            "rss": {t.name: t.rss.report() if t.rss else None for t in targets}})
    finally:
        for t in targets:
            _stop(t)
    if s.check_greedy:
        log(f"greedy check: up to {s.check_greedy} requests per moeswap server against `moeswap generate`")
        report["greedy_check"] = check_greedy(s.model_dir, s.load, {t.name: runs[t.name] for t in targets if t.moeswap},
                                              s.check_greedy, s.threads if s.launch else None)
    return report


def _stop(t: Target) -> None:
    if t.rss:
        t.rss.stop()
    if t.process:
        t.process.stop()


def _ratios(main: dict, peer: dict) -> dict:
    def div(a, b):
        return a / b if a is not None and b else None

    return {"output_throughput": div(main["output_throughput"], peer["output_throughput"]),
            "p99_ttft": div(main["ttft_ms"]["p99"], peer["ttft_ms"]["p99"])}


# ----------------------------------------------------------------------------------------------------
# Reports


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _three(p: dict) -> str:
    return " / ".join(_fmt(p[k]) for k in ("p50", "p90", "p99"))


def format_markdown(r: dict) -> str:
    m, w = r["machine"], r["workload"]
    what = f"`moeswap serve {r['launch']}` (launched)" if r["launch"] else f"`{r['url']}`"
    span = lambda a: str(a[0]) if a[0] == a[1] else f"{a[0]}..{a[1]}"  # noqa: E731
    count = (f"{w['num_requests']} requests" if w["num_requests"] else "") + (
        (" or " if w["num_requests"] else "") + f"{w['duration_s']:g} s" if w["duration_s"] else "")
    lines = [f"{what}, {m['threads']} threads, on {m['cores']} cores ({m['cpu']}), git {m['git']}, load average "
             f"{m['load_average'][0]:.1f} at start",
             f"workload: prompts of {span(w['prompt_tokens'])} random tokens, {span(w['output_tokens'])} output "
             f"tokens (max_tokens, ignore_eos), greedy, streamed `/v1/completions`; {count} per load after "
             f"{w['warmup']} warm-up requests"]
    for name, srv in r["servers"].items():
        extra = f"; {srv['version']}" if srv.get("version") else ""
        how = f"`{srv['command']}`" if srv.get("command") else srv["url"]
        lines.append(f"- {name}: {how} (prompts as {srv.get('prompts', '?')}{extra})")
    for name, why in r["skipped"].items():
        lines.append(f"- {name}: SKIPPED, {why}")
    lines += ["", "| server | load | done / sent | req/s | output tok/s | TTFT ms p50 / p90 / p99 | "
                  "TPOT ms p50 / p90 / p99 | ITL ms p50 / p90 / p99 | E2E ms p50 / p99 |",
              "|---|---|---:|---:|---:|---|---|---|---|"]
    for row in r["rows"]:
        load = str(Level(row.get("concurrency"), row.get("request_rate")))
        for name, x in row["results"].items():
            lines.append(f"| {name} | {load} | {x['completed']} / {x['sent']} | {_fmt(x['request_throughput'], 2)} | "
                         f"{_fmt(x['output_throughput'])} | {_three(x['ttft_ms'])} | {_three(x['tpot_ms'])} | "
                         f"{_three(x['itl_ms'])} | {_fmt(x['e2e_ms']['p50'], 0)} / {_fmt(x['e2e_ms']['p99'], 0)} |")
    for row in r["rows"]:
        load = str(Level(row.get("concurrency"), row.get("request_rate")))
        lines.append(f"\n{load}: " + "; ".join(
            f"{name}: the client used {x['client_cpu_s'] / x['duration_s']:.0%} of a core, load average "
            f"{x['load_average_end']:.1f} at the end" for name, x in row["results"].items() if x["duration_s"]))
    ratio_rows = [(row, peer, q) for row in r["rows"] for peer, q in row["ratios"].items()]
    if ratio_rows:
        lines += ["", f"| load | peer | {r['target']} / peer output tok/s | {r['target']} / peer p99 TTFT |",
                  "|---|---|---:|---:|"]
        for row, peer, q in ratio_rows:
            load = str(Level(row.get("concurrency"), row.get("request_rate")))
            lines.append(f"| {load} | {peer} | {_fmt(q['output_throughput'], 2)}x | {_fmt(q['p99_ttft'], 2)}x |")
    mem = {k: v for k, v in r["rss"].items() if v}
    if mem:
        lines += ["", "| server RSS, MiB | loaded | after warm-up | end | peak after warm-up | end - after warm-up |",
                  "|---|---:|---:|---:|---:|---:|"]
        mib = lambda b: _fmt(None if b is None else b / MIB)  # noqa: E731
        for name, x in mem.items():
            lines.append(f"| {name} | {mib(x.get('loaded_bytes'))} | {mib(x.get('after_warmup_bytes'))} | "
                         f"{mib(x.get('end_bytes'))} | {mib(x['peak_after_warmup_bytes'])} | "
                         f"{mib(x['growth_after_warmup_bytes'])} |")
    failures = [(name, row, x) for row in r["rows"] for name, x in row["results"].items() if x["failed"]]
    if failures:
        lines.append("")
        for name, row, x in failures:
            load = str(Level(row.get("concurrency"), row.get("request_rate")))
            lines.append(f"- {name}, {load}: {x['failed']} failed; first errors: " + "; ".join(x["first_errors"]))
    g = r.get("greedy_check")
    if g:
        verdict = (f"{g['equal']} of {g['checked']} greedy responses equal `moeswap generate`'s tokens"
                   + ("" if g["ok"] else f": NOT EQUAL {g['mismatches'] or g.get('note', '')}"))
        lines += ["", f"greedy check: {verdict}"]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> bool:
    """Latency against output throughput, one line per server over the load levels: p99 TTFT and p50 TPOT."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, (key, q, label) in zip(axes, (("ttft_ms", "p99", "TTFT p99 (ms)"), ("tpot_ms", "p50", "TPOT p50 (ms)"))):
        for name in r["servers"]:
            pts = [(row["results"][name]["output_throughput"], row["results"][name][key][q],
                    row.get("concurrency") or row.get("request_rate")) for row in r["rows"] if name in row["results"]]
            pts = [p for p in pts if p[0] is not None and p[1] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            for x, y, lv in pts:
                ax.annotate(f"{lv:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    kind = "concurrency" if r["rows"][0].get("concurrency") else "request rate"
    fig.suptitle(f"latency vs throughput ({kind} at each point)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------
# The command


def add_parser(benches) -> None:
    from moeswap.bench.sidebyside import BENCH_LOAD
    from moeswap.server.options import ServeOptions

    b = benches.add_parser("serve", help="load on an OpenAI-compatible server: TTFT, TPOT, ITL, throughput, RSS; "
                                         "vs moeswap --max-batch 1 and llama-server")
    where = b.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="MODEL", help="start `moeswap serve MODEL` on a free loopback port")
    load = b.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="comma list of fixed concurrencies, one run each (default 8)")
    load.add_argument("--request-rate", help="comma list of Poisson arrival rates in requests/s, one run each")
    b.add_argument("--num-requests", type=int, help="requests per load (default 32; with --duration: at most)")
    b.add_argument("--duration", type=float, help="seconds per load: no request is sent after it")
    b.add_argument("--warmup", type=int, help="unmeasured requests per server first (default: the largest "
                                              "concurrency, else 4)")
    b.add_argument("--prompt-tokens", default="128", help="prompt length N or LO:HI (uniform); default 128")
    b.add_argument("--output-tokens", default="128", help="max_tokens N or LO:HI (uniform), with ignore_eos; "
                                                          "default 128")
    b.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    b.add_argument("--peers", default=None, help=f"comma list of {', '.join(PEERS)} ('' = none; default: both with "
                                                 "--launch, none with --url)")
    b.add_argument("--threads", type=int, default=2, help="threads of every launched server (default 2)")
    b.add_argument("--max-batch", type=int, default=ServeOptions().max_batch,
                   help="launched moeswap's --max-batch and llama-server's --parallel (default %(default)s)")
    b.add_argument("--max-queue", type=int, default=1024, help="launched moeswap servers' --max-queue (default "
                                                               "%(default)s: requests wait rather than get 429)")
    b.add_argument("--model-dir", help="with --url: the checkpoint it serves (token-id prompts, peers, "
                                       "--check-greedy)")
    b.add_argument("--api-key", help="with --url: its key (default $MOESWAP_API_KEY)")
    b.add_argument("--server-pid", type=int, help="with --url: the server's process id, to sample its RSS")
    b.add_argument("--llama-server", metavar="PATH", help="the llama-server binary (default: on PATH, else "
                                                          ".peers/bin/llama-server from scripts/setup-peers.sh)")
    b.add_argument("--gguf", help="an existing GGUF for llama-server (default: convert the checkpoint)")
    b.add_argument("--check-greedy", type=int, nargs="?", const=8, metavar="N",
                   help="compare N completed requests per moeswap server (default 8) with `moeswap generate`")
    b.add_argument("--out-dir", default="bench-results", help="where the JSON, markdown and PNG go ('' = only print)")
    b.add_argument("--json", metavar="FILE", help="JSON path (default: OUT_DIR/serve-<time>.json)")
    b.add_argument("--markdown", metavar="FILE", help="markdown path (default: OUT_DIR/serve-<time>.md)")
    add_load_flags(b, defaults={"expert_memory": BENCH_LOAD.expert_memory},
                   title="how launched moeswap servers load the model (default --expert-memory: every expert of a "
                         "bench model stays)")


def _levels(args) -> list[Level]:
    from moeswap.bench.sidebyside import int_list

    if args.request_rate:
        try:
            rates = [float(v) for v in args.request_rate.split(",") if v]
        except ValueError:
            raise ValueError(f"--request-rate {args.request_rate!r}: expected a comma list of numbers") from None
        if not rates or not all(math.isfinite(x) and x > 0 for x in rates):
            raise ValueError(f"--request-rate {args.request_rate!r}: expected positive rates")
        return [Level(rate=x) for x in rates]
    return [Level(concurrency=c) for c in int_list(args.concurrency or "8", "--concurrency")]


def setup_from_args(args) -> Setup:
    from moeswap.server.cli import API_KEY_ENV

    levels = _levels(args)
    for flag, value, low in (("--num-requests", args.num_requests, 1), ("--threads", args.threads, 1),
                             ("--max-batch", args.max_batch, 1), ("--max-queue", args.max_queue, 0),
                             ("--warmup", args.warmup, 0), ("--check-greedy", args.check_greedy, 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--duration", args.duration), ("--timeout", args.timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    num = args.num_requests if args.num_requests is not None or args.duration else 32
    warmup = args.warmup if args.warmup is not None else max((lv.concurrency or 4) for lv in levels)
    w = Workload(Lengths.parse(args.prompt_tokens, "--prompt-tokens"), Lengths.parse(args.output_tokens,
                 "--output-tokens"), num, args.duration, warmup, args.seed, args.timeout)
    peers = tuple(p for p in (args.peers if args.peers is not None else ",".join(PEERS) if args.launch else "")
                  .split(",") if p)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"--peers: unknown peer {unknown[0]!r}; known: {', '.join(PEERS)}")
    if args.launch and (args.model_dir or args.server_pid):
        raise ValueError("--model-dir and --server-pid go with --url (--launch knows both)")
    model_dir = args.launch or args.model_dir
    if model_dir and not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json; give a checkpoint directory")
    if args.check_greedy and not model_dir:
        raise ValueError("--check-greedy needs the checkpoint: --launch MODEL, or --model-dir with --url")
    if args.url and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url {args.url!r}: expected http://HOST:PORT")
    if args.server_pid is not None and rss_bytes(args.server_pid) is None:
        raise ValueError(f"--server-pid {args.server_pid}: no such process on this machine (or no /proc)")
    return Setup(w, levels, url=args.url, launch=args.launch, model_dir=model_dir, peers=peers,
                 threads=args.threads, max_batch=args.max_batch, max_queue=args.max_queue,
                 load=LoadOptions.from_args(args),
                 api_key=None if args.launch else args.api_key or os.environ.get(API_KEY_ENV) or None,
                 server_pid=args.server_pid, llama_server=args.llama_server, gguf=args.gguf,
                 check_greedy=args.check_greedy)


def run(args: argparse.Namespace) -> int:
    from moeswap.bench.sidebyside import write_report

    if importlib.util.find_spec("httpx") is None:
        raise ValueError("bench serve needs httpx (a test extra, not a dependency): pip install httpx")
    setup = setup_from_args(args)
    report = measure(setup, log=lambda m: print(m, file=sys.stderr, flush=True))
    md = format_markdown(report)
    print(md)
    paths = write_report("serve", report, md, args.out_dir or None, args.json, args.markdown)
    if len(setup.levels) > 1 and paths:
        png = Path(paths[0]).with_suffix(".png")
        paths.append(str(png) if plot(report, png) else "no PNG: matplotlib is not installed")
    for path in paths:
        print(f"wrote {path}")
    failed = any(x["failed"] for row in report["rows"] for x in row["results"].values())
    greedy = report.get("greedy_check")
    return 1 if failed or (greedy and not greedy["ok"]) else 0
