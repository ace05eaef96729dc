"""The `moeswap bench serve` command: its flags, their checks into a runner.Setup, and the run that prints
and writes the report. Entry points: `add_parser(benches)`, `run(args)`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path

from moeswap.bench import RESULTS_DIR
from moeswap.bench.serve.report import format_markdown, plot
from moeswap.bench.serve.runner import PEERS, Setup, measure
from moeswap.bench.serve.workload import Lengths, Level, Workload
from moeswap.options import LoadOptions, add_load_flags
from moeswap.procfs import rss_bytes


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
    b.add_argument("--out-dir", default=RESULTS_DIR,
                   help="where the JSON, markdown and PNG go ('' = only print; default %(default)s)")
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
