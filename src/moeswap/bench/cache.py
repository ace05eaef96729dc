"""`moeswap bench cache --trace trace.bin`: hit rate vs fast-tier budget for every cache policy, replayed
from a routing trace without running the model.

The replay drives the real ExpertStore (same pins, same policies) with one-byte placeholder experts,
so a budget is a number of experts: a percentage of all routed experts of the traced model. Belady is
the offline optimum (a bound), static is profiled on the same trace unless --profile names another
(so it is optimistic); the best online policy (lru, lfu, lfru) is reported next to LRU and Belady.
Writes a markdown table, a PNG plot and JSON. Entry point: `replay(trace, policy, slots)`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, move_into, writing
from moeswap.bench import RESULTS_DIR
from moeswap.experts.keys import Key
from moeswap.experts.policy import POLICIES, lfru_half_life, make_policy, online_policies
from moeswap.experts.stats import TierStats
from moeswap.experts.store import ExpertStore
from moeswap.experts.tiers import MemoryTier, Tier
from moeswap.experts.trace import Trace, read_trace

DEFAULT_BUDGETS = (5, 10, 15, 20, 25, 35, 50, 75, 100)


class _Placeholder:
    nbytes = 1


class _TraceSource(Tier):
    """Every expert, instantly: only which keys are resident matters in a replay."""

    name, capacity = "trace", math.inf

    def get(self, key: Key):
        return _Placeholder


def replay(trace: Trace, policy: str, slots: int, profile: dict | None = None,
           future: list[Key] | None = None) -> TierStats:
    """Fast-tier hits and misses of `policy` with room for `slots` experts over the trace's accesses."""
    pol = make_policy(policy, profile=profile if profile is not None else trace.profile(),
                      future=future if future is not None else trace.accesses(), half_life=lfru_half_life(slots))
    store = ExpertStore([MemoryTier("fast", slots, cost=lambda k: 1), _TraceSource()], [pol])
    for _, layer, ids in trace.events():
        for _ in store.fetch(layer, ids):
            pass
    return store.stats.fast


def total_experts(trace: Trace) -> int:
    return len(trace.meta["moe_layers"]) * trace.meta["num_experts"]


def run_replays(trace: Trace, budgets=DEFAULT_BUDGETS, policies=None, profile: dict | None = None) -> list[dict]:
    policies = tuple(POLICIES) if policies is None else policies
    total, top_k = total_experts(trace), trace.meta.get("top_k", 1)
    future, profile = trace.accesses(), profile if profile is not None else trace.profile()
    rows = []
    for pct in budgets:
        slots = max(1, round(total * pct / 100))
        row = {"budget_pct": pct, "slots": slots, "hit_rate": {}}
        if slots < top_k:
            row["note"] = f"below one layer's {top_k} active experts"
        else:
            for p in policies:
                row["hit_rate"][p] = replay(trace, p, slots, profile, future).hit_rate
            online = {p: row["hit_rate"][p] for p in online_policies() if p in row["hit_rate"]}
            if online:
                row["best_online"] = max(online, key=online.get)
        rows.append(row)
    return rows


def environment() -> dict:
    """What a benchmark ran on: git revision, machine, threads, versions."""
    import torch

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev, dirty = "", ""
    return {"git": rev + ("+dirty" if dirty else ""), "machine": platform.machine(), "cpu": platform.processor(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__, "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def format_table(rows: list[dict], policies) -> str:
    head = ["budget", "experts kept", *policies, "best online vs LRU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "note" in r:
            lines.append(f"| {r['budget_pct']}% | {r['slots']} | " + " | ".join("—" for _ in policies) + f" | {r['note']} |")
            continue
        cells = [f"{r['hit_rate'][p]:.1%}" for p in policies]
        best = r.get("best_online")
        extra = ""
        if best:
            gain = r["hit_rate"][best] - r["hit_rate"].get("lru", float("nan"))
            extra = f"{best} {r['hit_rate'][best]:.1%} ({gain * 100:+.1f} pts)"
        lines.append(f"| {r['budget_pct']}% | {r['slots']} | " + " | ".join(cells) + f" | {extra} |")
    return "\n".join(lines)


def plot(rows: list[dict], policies, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        pts = [(r["budget_pct"], r["hit_rate"][p]) for r in rows if p in r["hit_rate"]]
        style = "--" if p == "belady" else ":" if p == "static" else "-"
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], style, marker="o", ms=3, label=p)
    ax.set_xlabel("fast-tier budget (% of all routed experts)")
    ax.set_ylabel("fast-tier hit rate (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def add_parser(benches) -> None:
    b = benches.add_parser("cache", help="replay a routing trace against every cache policy and budget")
    b.add_argument("--trace", required=True, help="routing trace from `moeswap trace`")
    b.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                   help="fast-tier budgets in %% of all routed experts (default %(default)s)")
    b.add_argument("--policies", default=",".join(POLICIES), help="default %(default)s")
    b.add_argument("--profile", help="trace to profile the static policy on (default: the replayed trace itself)")
    b.add_argument("--out-dir", default=RESULTS_DIR, help="where cache-hit-rate.{md,png,json} go (default: %(default)s)")


def comma_list(text: str, flag: str, cast=str) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a comma-separated list") from None


def run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    budgets = comma_list(args.budgets, "--budgets", float)
    if not budgets or any(not 0 < b <= 100 for b in budgets):
        raise ValueError(f"--budgets {args.budgets!r}: expected percentages in (0, 100]")
    budgets = [int(b) if b == int(b) else b for b in budgets]
    policies = comma_list(args.policies, "--policies")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}; expected some of {', '.join(POLICIES)}")
    profile = read_trace(args.profile).profile() if args.profile else None
    t0 = time.perf_counter()
    rows = run_replays(trace, budgets, policies, profile)
    elapsed = time.perf_counter() - t0
    total = total_experts(trace)
    title = (f"{Path(trace.meta.get('model', '?')).name}: {len(trace.accesses())} expert uses, "
             f"{trace.num_steps} steps, {total} experts")
    table = format_table(rows, policies)
    static_note = f"static profiled on {args.profile}" if args.profile else "static profiled on this same trace (optimistic)"
    md = (f"Fast-tier hit rate by budget, replayed from `{args.trace}` ({title}). Belady is the offline optimum; "
          f"{static_note}.\n\n{table}\n")
    out = Path(args.out_dir)
    result = {"bench": "cache", "trace": str(args.trace), "trace_meta": trace.meta, "accesses": len(trace.accesses()),
              "steps": trace.num_steps, "total_experts": total, "rows": rows, "replay_s": elapsed,
              "static_profile": args.profile or "same trace", "environment": environment()}
    # the three files as one set, complete or absent: a disk that fills up leaves none of them behind
    staging = out / ".cache-hit-rate.staging"
    shutil.rmtree(staging, ignore_errors=True)  # from a run killed between publishing and moving
    with atomic_directory(staging) as tmp:
        with writing(out / "cache-hit-rate.md"):
            (tmp / "cache-hit-rate.md").write_text(md)
        with writing(out / "cache-hit-rate.json"):
            (tmp / "cache-hit-rate.json").write_text(jsonio.dumps(result, indent=2) + "\n")
        with writing(out / "cache-hit-rate.png"):
            png = plot(rows, policies, tmp / "cache-hit-rate.png", title)
    move_into(staging, out)
    print(md)
    print(f"wrote {out / 'cache-hit-rate.md'}, {out / 'cache-hit-rate.json'}"
          + (f", {out / 'cache-hit-rate.png'}" if png else " (no PNG: matplotlib is not installed)")
          + f" in {elapsed:.1f}s")
    return 0
