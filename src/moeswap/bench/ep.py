"""`moeswap bench ep MODEL --nproc N`: greedy decode on 1 process and on N expert-parallel ranks of this
machine, in both modes (replicated attention; data-parallel attention with token dispatch): tokens/s, bytes
received per token per MoE layer against the planner's figure, time in the collectives. Both sides must
give the same tokens (checked and reported). Writes ep-<time>.{md,json}. Entry points: `add_parser`, `run`.
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
from moeswap.bench import RESULTS_DIR
from moeswap.options import LoadOptions, add_load_flags, add_model_argument

BASELINE = "1 process"


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def worker(job: dict) -> None:
    """One rank (or the single process): warm-up generate, then the timed one(s); rank 0 writes everything.
    job["sequences"]: how many sequences (sequence i: prompt seed 0 for i = 0, else 100 + i); in the
    data-parallel mode sequence i runs on rank i % N, in one process all of them one after another."""
    import torch

    from moeswap.distributed.cli import data_parallel_map
    from moeswap.distributed.runtime import init_expert_parallel, launched, shutdown
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import load_model

    torch.set_num_threads(job["threads"])
    options = LoadOptions(**job["options"])
    model, store = load_model(job["model"], options)
    dp = job["mode"] == "data-parallel"
    ep = init_expert_parallel(model, job["model"], options, job["placement"], data_parallel=dp) if launched() else None
    vocab, n = model.config.vocab_size, job["sequences"]
    prompts = [_prompt(vocab, job["prompt_tokens"], 0 if i == 0 else 100 + i) for i in range(n)]
    warm = [_prompt(vocab, job["prompt_tokens"], 1 if i == 0 else 200 + i) for i in range(n)]
    cfg = GenerationConfig(max_tokens=job["max_tokens"], stop_ids=())

    def run(batch: list[list[int]]) -> list[dict]:
        if dp:  # sequence i on rank i % N; idle ranks answer the others' exchanges
            return data_parallel_map(ep, len(batch), lambda i: _summary(generate(model, batch[i], cfg)))
        return [_summary(generate(model, p, cfg)) for p in batch]

    run(warm)  # untimed: kernels built, caches and experts warm
    if ep is not None:
        import torch.distributed as dist

        from moeswap.distributed.ep import EPStats

        ep.stats = EPStats()
        if dp:
            from moeswap.distributed.dispatch import DispatchStats

            ep.dispatch.stats = DispatchStats()
        dist.barrier()  # the ranks start the timed run together
    t0 = time.perf_counter()
    results = run(prompts)
    wall = time.perf_counter() - t0
    one = results[0]
    stats = None if ep is None else (ep.dispatch if dp else ep).stats.as_dict()
    row = {**one, "sequences": results, "wall_s": wall, "disk_reads": store.stats.disk_reads, "ep": stats}
    rows = [row]
    if ep is not None:
        rows = [None] * ep.world
        dist.all_gather_object(rows, row)
    store.close()
    if ep is not None:
        shutdown(ep)
    if ep is None or ep.rank == 0:
        Path(job["out"]).write_text(jsonio.dumps({"ranks": rows}))


def _summary(result) -> dict:
    return {"tokens": result.tokens, "decode_tokens_per_s": result.decode_tokens_per_s, "ttft_s": result.ttft_s,
            "native_steps": result.native_steps}


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


MODES = ("both", "replicated", "data-parallel")


def run_bench(model_dir: str, nproc: int, options: LoadOptions, prompt_tokens: int, max_tokens: int, threads: int,
              placement: str | None, timeout_s: float = 1800, mode: str = "both") -> dict:
    """Ranks start as torchrun would start them (distributed/launch.py). Replicated attention: every rank the
    same sequence (distributed/ep.py); data-parallel: rank r its own sequence r (distributed/dispatch.py).
    The planner's figure is planner/roofline.py expert_exchange_bytes: its "replicated" form, and its default
    "data-parallel" form, whose dispatch term the data-parallel run is compared with. The baseline, "1 process",
    is the same model, options and prompts without torch.distributed (for the data-parallel run it generates the
    N sequences one after another)."""
    from moeswap.bench.cache import environment
    from moeswap.config import load_config
    from moeswap.models.loader import resolve_dtype
    from moeswap.planner.layouts import Layout
    from moeswap.planner.roofline import expert_exchange_bytes

    config = load_config(model_dir)
    job = {"model": str(model_dir), "options": dataclasses.asdict(options), "prompt_tokens": prompt_tokens,
           "max_tokens": max_tokens, "threads": threads, "placement": placement}
    itemsize = resolve_dtype(options.dtype, options.device).itemsize
    lay = Layout(dp=nproc, ep=nproc)
    result = {
        "bench": "ep", "model": str(model_dir), "nproc": nproc, "placement": placement or "contiguous", "mode": mode,
        "dtype": str(resolve_dtype(options.dtype, options.device)).removeprefix("torch."),
        "expert_memory": options.expert_memory, "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens, "threads_per_rank": threads, "baseline": BASELINE, "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="moeswap-bench-ep-") as tmp:  # rank 0's hand-over files
        def launch(world: int, run_mode: str, sequences: int) -> list[dict]:
            out = str(Path(tmp) / f"{run_mode}-{world}.json")
            return _launch({**job, "mode": run_mode, "sequences": sequences, "out": out}, world, timeout_s)["ranks"]

        if mode in ("both", "replicated"):
            runs = {1: launch(1, "replicated", 1), nproc: launch(nproc, "replicated", 1)}
            result.update(_replicated(runs, nproc, expert_exchange_bytes(config, lay, 1, itemsize, "replicated"),
                                      expert_exchange_bytes(config, lay, 1, itemsize)))
        if mode in ("both", "data-parallel"):
            runs_dp = {1: launch(1, "data-parallel", nproc), nproc: launch(nproc, "data-parallel", nproc)}
            result["data_parallel"] = _data_parallel(runs_dp, nproc, expert_exchange_bytes(config, lay, 1, itemsize))
    result["environment"] = environment()
    return result


def _replicated(runs: dict, nproc: int, predicted: float, predicted_dp: float) -> dict:
    one, many = runs[1][0], runs[nproc]
    per_rank = [r["ep"]["bytes_received_per_token_per_layer"] for r in many]
    measured = sum(per_rank) / len(per_rank)
    coll = [r["ep"]["collective_s"] for r in many]
    return {
        "same_tokens": all(r["tokens"] == one["tokens"] for r in many),
        "tokens_per_s": {"1": one["decode_tokens_per_s"], str(nproc): many[0]["decode_tokens_per_s"]},
        "speedup": ((many[0]["decode_tokens_per_s"] or 0) / one["decode_tokens_per_s"]
                    if one["decode_tokens_per_s"] else None),
        "ttft_s": {"1": one["ttft_s"], str(nproc): many[0]["ttft_s"]},
        "bytes_per_token_per_layer": {"measured_mean_over_ranks": measured, "measured_per_rank": per_rank,
                                      "planner_replicated": predicted, "planner_data_parallel": predicted_dp,
                                      "ratio_measured_to_planner": measured / predicted if predicted else None},
        "time_s": {"wall_per_rank": [r["wall_s"] for r in many], "collective_per_rank": coll,
                   "experts_per_rank": [r["ep"]["expert_s"] for r in many],
                   "combine_per_rank": [r["ep"]["combine_s"] for r in many],
                   "collective_share_per_rank": [c / r["wall_s"] for c, r in zip(coll, many)],
                   "wall_1": one["wall_s"]},
        "disk_reads": {"1": one["disk_reads"], "per_rank": [r["disk_reads"] for r in many]},
        "runs": {"1": runs[1], str(nproc): many},
    }


def _data_parallel(runs: dict, nproc: int, predicted: float) -> dict:
    """Sequence i on rank i % N against the N sequences one after another in one process. Bytes per token
    of the whole batch (every rank's tokens) per MoE layer, one direction (the dispatch; the combine
    returns as many), as the planner counts them."""
    one, many = runs[1][0], runs[nproc]
    seqs_one = one["sequences"]
    seqs_many = many[0]["sequences"]  # every rank has every sequence's result
    generated = sum(len(s["tokens"]) for s in seqs_one)
    wall_many = max(r["wall_s"] for r in many)
    per_rank = [r["ep"]["dispatch_bytes_received_per_token_per_layer"] for r in many]
    combine = [r["ep"]["combine_bytes_received"] / r["ep"]["tokens_all_ranks"] for r in many]
    measured = sum(per_rank) / len(per_rank)
    coll = [r["ep"]["collective_s"] for r in many]
    return {
        "same_tokens": [s["tokens"] for s in seqs_many] == [s["tokens"] for s in seqs_one],
        "sequences": nproc,
        "generated_tokens_per_s": {"1": generated / one["wall_s"], str(nproc): generated / wall_many},
        "speedup": one["wall_s"] / wall_many,
        "bytes_per_token_per_layer": {"measured_mean_over_ranks": measured, "measured_per_rank": per_rank,
                                      "combine_mean_over_ranks": sum(combine) / len(combine),
                                      "planner_data_parallel": predicted,
                                      "ratio_measured_to_planner": measured / predicted if predicted else None},
        "time_s": {"wall_per_rank": [r["wall_s"] for r in many], "collective_per_rank": coll,
                   "experts_per_rank": [r["ep"]["expert_s"] for r in many],
                   "collective_share_per_rank": [c / r["wall_s"] for c, r in zip(coll, many)],
                   "wall_1": one["wall_s"]},
        "disk_reads": {"1": one["disk_reads"], "per_rank": [r["disk_reads"] for r in many]},
        "runs": {"1": runs[1], str(nproc): many},
    }


def format_report(r: dict) -> str:
    n = r["nproc"]
    lines = [
        f"Expert parallelism on {Path(r['model']).name}: {n} ranks (gloo, loopback, {r['threads_per_rank']} thread(s) "
        f"each; {r['placement']} placement) against {BASELINE}; greedy, {r['max_tokens']} tokens after a "
        f"{r['prompt_tokens']}-token prompt, dtype {r['dtype']}.",
    ]
    if "tokens_per_s" in r:
        b, t, tps = r["bytes_per_token_per_layer"], r["time_s"], r["tokens_per_s"]
        lines += [
            "", "Replicated attention (every rank the same sequence):", "",
            "| | 1 process | " + f"{n} ranks |", "|---|---|---|",
            f"| decode tokens/s | {tps['1']:.2f} | {tps[str(n)]:.2f} ({r['speedup']:.2f}x) |",
            f"| time to first token | {r['ttft_s']['1'] * 1e3:.1f} ms | {r['ttft_s'][str(n)] * 1e3:.1f} ms |",
            f"| experts read from disk | {r['disk_reads']['1']} | "
            + " / ".join(map(str, r["disk_reads"]["per_rank"])) + " |",
            "",
            f"Bytes received per token per MoE layer: {b['measured_mean_over_ranks']:.1f} (mean over ranks; per "
            "rank " + ", ".join(f"{x:.1f}" for x in b["measured_per_rank"]) + f"), planner "
            f"{b['planner_replicated']:.1f} (replicated attention; ratio {b['ratio_measured_to_planner']:.3f}).",
            "Time per rank in the exchange: " + _times(t) + ".",
            "Same tokens as 1 process." if r["same_tokens"] else "DIFFERENT TOKENS from 1 process.",
        ]
    d = r.get("data_parallel")
    if d is not None:
        b, t, g = d["bytes_per_token_per_layer"], d["time_s"], d["generated_tokens_per_s"]
        lines += [
            "", f"Data-parallel attention with token dispatch (rank r its own sequence r; {n} sequences):", "",
            "| | 1 process (one after another) | " + f"{n} ranks |", "|---|---|---|",
            f"| generated tokens/s, all sequences | {g['1']:.2f} | {g[str(n)]:.2f} ({d['speedup']:.2f}x) |",
            f"| experts read from disk | {d['disk_reads']['1']} | "
            + " / ".join(map(str, d["disk_reads"]["per_rank"])) + " |",
            "",
            f"Dispatch bytes received per token (of all ranks' tokens) per MoE layer: "
            f"{b['measured_mean_over_ranks']:.1f} (mean over ranks; per rank "
            + ", ".join(f"{x:.1f}" for x in b["measured_per_rank"]) + f"; the combine returns "
            f"{b['combine_mean_over_ranks']:.1f}), planner {b['planner_data_parallel']:.1f} (data-parallel "
            f"attention; ratio {b['ratio_measured_to_planner']:.3f}).",
            "Time per rank in the collectives: " + _times(t) + ".",
            "Same tokens as 1 process." if d["same_tokens"] else "DIFFERENT TOKENS from 1 process.",
        ]
    return "\n".join(lines)


def _times(t: dict) -> str:
    return (", ".join(f"{c:.3f} s of {w:.3f} s ({s:.0%})" for c, w, s in
                      zip(t["collective_per_rank"], t["wall_per_rank"], t["collective_share_per_rank"]))
            + "; computing the rank's experts " + ", ".join(f"{x:.3f} s" for x in t["experts_per_rank"]))


def add_parser(benches) -> None:
    b = benches.add_parser("ep", help="expert parallelism: 1 process vs N ranks on this machine, bytes and time "
                                      "in the exchange vs the planner")
    add_model_argument(b)
    b.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    b.add_argument("--prompt-tokens", type=int, default=16)
    b.add_argument("--max-tokens", type=int, default=32, help="decode steps timed (default 32)")
    b.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    b.add_argument("--ep-placement", default=None, metavar="TRACE", help="balanced placement from this routing trace")
    b.add_argument("--mode", choices=MODES, default="both",
                   help="replicated attention, data-parallel attention with token dispatch, or both (default)")
    add_load_flags(b, only=("dtype", "dense_weights", "expert_activations", "gemm_precision", "expert_memory",
                            "expert_policy", "prefetch"))
    b.add_argument("--out-dir", default=RESULTS_DIR, help="where ep-<time>.{md,json} go (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise ValueError(f"--nproc must be >= 2, got {args.nproc}")
    if args.max_tokens < 2 or args.prompt_tokens < 1 or args.threads < 1:
        raise ValueError("--max-tokens must be >= 2, --prompt-tokens >= 1 and --threads >= 1")
    options = LoadOptions.from_args(args)
    if options.device != "cpu":
        raise ValueError("bench ep runs on the CPU (gloo); use torchrun with NCCL for GPUs (docs/distributed.md)")
    t0 = time.perf_counter()
    result = run_bench(args.model, args.nproc, options, args.prompt_tokens, args.max_tokens, args.threads,
                       args.ep_placement, mode=args.mode)
    result["elapsed_s"] = time.perf_counter() - t0
    from moeswap.bench.sidebyside import write_report

    report = format_report(result)
    paths = write_report("ep", result, report, args.out_dir or None, None, None)
    print(report)
    print(f"wrote {' and '.join(paths)} in {result['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
