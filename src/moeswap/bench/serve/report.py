"""The reports of `bench serve`: the markdown tables and the latency-throughput plot, from the report dict
that runner.measure returns. Entry points: `format_markdown`, `plot`.
"""

from __future__ import annotations

from pathlib import Path

from moeswap.bench.serve.servers import MIB
from moeswap.bench.serve.workload import Level


def fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _three(p: dict) -> str:
    return " / ".join(fmt(p[k]) for k in ("p50", "p90", "p99"))


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
            lines.append(f"| {name} | {load} | {x['completed']} / {x['sent']} | {fmt(x['request_throughput'], 2)} | "
                         f"{fmt(x['output_throughput'])} | {_three(x['ttft_ms'])} | {_three(x['tpot_ms'])} | "
                         f"{_three(x['itl_ms'])} | {fmt(x['e2e_ms']['p50'], 0)} / {fmt(x['e2e_ms']['p99'], 0)} |")
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
            lines.append(f"| {load} | {peer} | {fmt(q['output_throughput'], 2)}x | {fmt(q['p99_ttft'], 2)}x |")
    mem = {k: v for k, v in r["rss"].items() if v}
    if mem:
        lines += ["", "| server RSS, MiB | loaded | after warm-up | end | peak after warm-up | end - after warm-up |",
                  "|---|---:|---:|---:|---:|---:|"]
        mib = lambda b: fmt(None if b is None else b / MIB)  # noqa: E731
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
