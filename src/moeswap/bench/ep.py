"""`moeswap bench ep MODEL --nproc N`: greedy decode on 1 process and on N expert-parallel ranks on this
machine (started as torchrun would: distributed/launch.py), side by side: tokens/s, bytes each rank
received per token per MoE layer, time in the collective against the rest, and the planner's figure for
the same exchange (planner/roofline.py expert_exchange_bytes, moeswap's replicated-attention form).

The baseline is named "1 process" (the same model, options and prompt, no torch.distributed). Both runs
must give the same tokens (checked and reported). Writes ep-<time>.{md,json} like the other benches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from moeswap import jsonio
from moeswap.options import LoadOptions, add_load_flags, add_model_argument

BASELINE = "1 process"


def worker(job: dict) -> None:
    """One rank (or the single process): warm-up generate, then the timed one; rank 0 writes everything."""
    import torch

    from moeswap.distributed.ep import EPStats
    from moeswap.distributed.runtime import init_expert_parallel, launched, shutdown
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import load_model

    torch.set_num_threads(job["threads"])
    options = LoadOptions(**job["options"])
    model, store = load_model(job["model"], options)
    ep = init_expert_parallel(model, job["model"], options, job["placement"]) if launched() else None
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (job["prompt_tokens"],), generator=torch.Generator().manual_seed(0)).tolist()
    warm = torch.randint(0, vocab, (job["prompt_tokens"],), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = GenerationConfig(max_tokens=job["max_tokens"], stop_ids=())
    generate(model, warm, cfg)  # untimed: kernels built, caches and experts warm
    if ep is not None:
        ep.stats = EPStats()
    t0 = time.perf_counter()
    result = generate(model, prompt, cfg)
    wall = time.perf_counter() - t0
    row = {"tokens": result.tokens, "decode_tokens_per_s": result.decode_tokens_per_s, "ttft_s": result.ttft_s,
           "wall_s": wall, "native_steps": result.native_steps, "disk_reads": store.stats.disk_reads,
           "ep": ep.stats.as_dict() if ep is not None else None}
    rows = [row]
    if ep is not None:
        import torch.distributed as dist

        rows = [None] * ep.world
        dist.all_gather_object(rows, row)
    store.close()
    if ep is not None:
        shutdown(ep)
    if ep is None or ep.rank == 0:
        Path(job["out"]).write_text(jsonio.dumps({"ranks": rows}))


def _launch(job: dict, world: int, timeout_s: float) -> dict:
    from moeswap.distributed.launch import run_ranks

    src = str(Path(__file__).resolve().parents[2])
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(job["threads"])}
    ranks = run_ranks([sys.executable, "-m", "moeswap.bench.ep", "--worker", json.dumps(job)], world, timeout_s, env)
    if any(c != 0 for c in ranks.codes):
        bad = next(r for r, c in enumerate(ranks.codes) if c != 0)
        tail = ranks.outputs[bad].strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"bench ep: rank {bad} of {world} exited with {ranks.codes[bad]}: {tail[0]}")
    return json.loads(Path(job["out"]).read_text())


def run_bench(model_dir: str, nproc: int, options: LoadOptions, prompt_tokens: int, max_tokens: int, threads: int,
              placement: str | None, timeout_s: float = 1800) -> dict:
    from moeswap.bench.cache import environment
    from moeswap.config import load_config
    from moeswap.models.loader import resolve_dtype
    from moeswap.planner.layouts import Layout
    from moeswap.planner.roofline import expert_exchange_bytes

    config = load_config(model_dir)
    job = {"model": str(model_dir), "options": dataclasses.asdict(options), "prompt_tokens": prompt_tokens,
           "max_tokens": max_tokens, "threads": threads, "placement": placement}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="moeswap-bench-ep-") as tmp:  # rank 0's hand-over files
        for world in (1, nproc):
            runs[world] = _launch({**job, "out": str(Path(tmp) / f"{world}.json")}, world, timeout_s)["ranks"]
    one, many = runs[1][0], runs[nproc]
    itemsize = resolve_dtype(options.dtype, options.device).itemsize
    lay = Layout(dp=nproc, ep=nproc)
    predicted = expert_exchange_bytes(config, lay, 1, itemsize, "replicated")
    per_rank = [r["ep"]["bytes_received_per_token_per_layer"] for r in many]
    measured = sum(per_rank) / len(per_rank)
    coll = [r["ep"]["collective_s"] for r in many]
    return {
        "bench": "ep", "model": str(model_dir), "nproc": nproc, "placement": placement or "contiguous",
        "dtype": str(resolve_dtype(options.dtype, options.device)).removeprefix("torch."),
        "expert_memory": options.expert_memory, "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens, "threads_per_rank": threads, "baseline": BASELINE,
        "same_tokens": all(r["tokens"] == one["tokens"] for r in many),
        "tokens_per_s": {"1": one["decode_tokens_per_s"], str(nproc): many[0]["decode_tokens_per_s"]},
        "speedup": ((many[0]["decode_tokens_per_s"] or 0) / one["decode_tokens_per_s"]
                    if one["decode_tokens_per_s"] else None),
        "ttft_s": {"1": one["ttft_s"], str(nproc): many[0]["ttft_s"]},
        "bytes_per_token_per_layer": {"measured_mean_over_ranks": measured, "measured_per_rank": per_rank,
                                      "planner_replicated": predicted,
                                      "planner_data_parallel": expert_exchange_bytes(config, lay, 1, itemsize),
                                      "ratio_measured_to_planner": measured / predicted if predicted else None},
        "time_s": {"wall_per_rank": [r["wall_s"] for r in many], "collective_per_rank": coll,
                   "experts_per_rank": [r["ep"]["expert_s"] for r in many],
                   "combine_per_rank": [r["ep"]["combine_s"] for r in many],
                   "collective_share_per_rank": [c / r["wall_s"] for c, r in zip(coll, many)],
                   "wall_1": one["wall_s"]},
        "disk_reads": {"1": one["disk_reads"], "per_rank": [r["disk_reads"] for r in many]},
        "runs": {"1": runs[1], str(nproc): many}, "environment": environment(),
    }


def format_report(r: dict) -> str:
    n, b, t = r["nproc"], r["bytes_per_token_per_layer"], r["time_s"]
    tps = r["tokens_per_s"]
    lines = [
        f"Expert parallelism on {Path(r['model']).name}: {n} ranks (gloo, loopback, {r['threads_per_rank']} thread(s) "
        f"each; {r['placement']} placement) against {BASELINE}; greedy, {r['max_tokens']} tokens after a "
        f"{r['prompt_tokens']}-token prompt, dtype {r['dtype']}.",
        "",
        "| | 1 process | " + f"{n} ranks |", "|---|---|---|",
        f"| decode tokens/s | {tps['1']:.2f} | {tps[str(n)]:.2f} ({r['speedup']:.2f}x) |",
        f"| time to first token | {r['ttft_s']['1'] * 1e3:.1f} ms | {r['ttft_s'][str(n)] * 1e3:.1f} ms |",
        f"| experts read from disk | {r['disk_reads']['1']} | "
        + " / ".join(map(str, r["disk_reads"]["per_rank"])) + " |",
        "",
        f"Bytes received per token per MoE layer: {b['measured_mean_over_ranks']:.1f} (mean over ranks; per rank "
        + ", ".join(f"{x:.1f}" for x in b["measured_per_rank"]) + f"), planner {b['planner_replicated']:.1f} "
        f"(replicated attention, as built; ratio {b['ratio_measured_to_planner']:.3f}); with data-parallel attention "
        f"the planner's layout would move {b['planner_data_parallel']:.1f} per direction.",
        "Time per rank in the exchange: " + ", ".join(
            f"{c:.3f} s of {w:.3f} s ({s:.0%})" for c, w, s in
            zip(t["collective_per_rank"], t["wall_per_rank"], t["collective_share_per_rank"]))
        + "; computing the rank's experts " + ", ".join(f"{x:.3f} s" for x in t["experts_per_rank"]) + ".",
        "Same tokens as 1 process." if r["same_tokens"] else "DIFFERENT TOKENS from 1 process.",
    ]
    return "\n".join(lines)


def add_parser(benches) -> None:
    b = benches.add_parser("ep", help="expert parallelism: 1 process vs N ranks on this machine, bytes and time "
                                      "in the exchange vs the planner")
    add_model_argument(b)
    b.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    b.add_argument("--prompt-tokens", type=int, default=16)
    b.add_argument("--max-tokens", type=int, default=32, help="decode steps timed (default 32)")
    b.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    b.add_argument("--ep-placement", default=None, metavar="TRACE", help="balanced placement from this routing trace")
    add_load_flags(b, only=("dtype", "dense_weights", "expert_activations", "gemm_precision", "expert_memory",
                            "expert_policy", "prefetch"))
    b.add_argument("--out-dir", default="bench-results", help="where ep-<time>.{md,json} go (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise ValueError(f"--nproc must be >= 2, got {args.nproc}")
    if args.max_tokens < 2 or args.prompt_tokens < 1 or args.threads < 1:
        raise ValueError("--max-tokens must be >= 2, --prompt-tokens >= 1 and --threads >= 1")
    options = LoadOptions.from_args(args)
    if options.device != "cpu":
        raise ValueError("bench ep runs on the CPU (gloo); use torchrun with NCCL for GPUs (docs/distributed.md)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = run_bench(args.model, args.nproc, options, args.prompt_tokens, args.max_tokens, args.threads,
                       args.ep_placement)
    result["elapsed_s"] = time.perf_counter() - t0
    report = format_report(result)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    md, js = out / f"ep-{stamp}.md", out / f"ep-{stamp}.json"
    md.write_text(report + "\n")
    js.write_text(jsonio.dumps(result, indent=2) + "\n")
    print(report)
    print(f"wrote {md} and {js} in {result['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
