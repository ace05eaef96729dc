"""One `bench serve` run: start the target and its peers, warm each up, run every load level on each in
turn (round-robin), stop them, then the greedy check; the result is the report dict. Entry point:
`measure(Setup(...))`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from moeswap.bench.serve.client import Outcome, prepare, run_level
from moeswap.bench.serve.greedy import check_greedy
from moeswap.bench.serve.report import fmt
from moeswap.bench.serve.servers import RssSampler, Target, moeswap_argv, ready, spawn
from moeswap.bench.serve.stats import summarize
from moeswap.bench.serve.workload import Level, Prompts, Workload, vocabulary
from moeswap.options import LoadOptions
from moeswap.procfs import cpu_model

PEERS = ("moeswap-batch1", "llama-server")


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
    from moeswap.bench.sidebyside import git_revision

    w = s.workload
    prompts = Prompts(w, vocabulary(s.model_dir) if s.model_dir else None)
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads)}  # the same threads as llama-server's -t / -tb
    targets: list[Target] = []
    skipped: dict[str, str] = {}
    report: dict = {"bench": "serve", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "machine": {"git": git_revision(), "cpu": cpu_model(), "cores": os.cpu_count(),
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
                outcomes, duration = asyncio.run(run_level(t, prompts, w, level, s.api_key))
                runs[t.name].append(outcomes)
                r = row["results"][t.name] = summarize(outcomes, duration)
                # what else ran: this client's own CPU time, and the machine's load when the level ended
                r["client_cpu_s"], r["load_average_end"] = time.process_time() - cpu, os.getloadavg()[0]
                log(f"  {r['completed']}/{r['sent']} done in {duration:.1f} s: {fmt(r['output_throughput'])} "
                    f"output tok/s, TTFT p99 {fmt(r['ttft_ms']['p99'])} ms")
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
