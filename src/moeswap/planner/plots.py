"""PNG plots of a PlanResult: memory breakdown per device, and throughput / TPOT vs concurrency.

matplotlib is optional (the `plot` extra): without it `write_plots` says so and returns no files.
Entry point: `write_plots`.
"""

from __future__ import annotations

from pathlib import Path

from .plan import PlanResult

GB = 1e9


def write_plots(r: PlanResult, folder: str | Path, top: int = 5) -> tuple[list[Path], str | None]:
    """Write the plots into `folder`; returns (files, why none were written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'moeswap[plot]'); skipping plots"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = [_memory_plot(r, folder / "memory.png", top, plt)]
    if r.request.workload == "serve":
        files.append(_serve_plot(r, folder / "throughput_tpot.png", top, plt))
    else:
        files.append(_lora_plot(r, folder / "lora_throughput.png", top, plt))
    return files, None


def _memory_plot(r: PlanResult, path: Path, top: int, plt) -> Path:
    bars = []  # (label, parts) per stage device of the top layouts
    for c in r.candidates[:top]:
        for m in c.memory:
            label = c.layout.name + (f" s{m.stage}" if len(c.memory) > 1 else "")
            bars.append((label, m.parts, m.capacity))
    keys = []
    for _, parts, _ in bars:
        keys += [k for k in parts if k not in keys]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(bars) + 3), 5))
    bottom = [0.0] * len(bars)
    for k in keys:
        vals = [parts.get(k, 0) / GB for _, parts, _ in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=k)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = bars[0][2] / GB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1, label=f"capacity {cap:.0f} GB")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b[0] for b in bars], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GB per device")
    ax.set_title(f"{r.model_label} on {r.request.devices} x {r.hardware.name}: memory per device")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _serve_plot(r: PlanResult, path: Path, top: int, plt) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for c in r.candidates[:top]:
        xs = [p.concurrency for p in c.points if p.fits]
        a1.plot(xs, [p.tok_s_device for p in c.points if p.fits], marker="o", label=c.layout.name)
        a2.plot(xs, [p.tpot * 1e3 for p in c.points if p.fits], marker="o", label=c.layout.name)
    for ax, title in ((a1, "tokens/s per device (input + output)"), (a2, "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=7)
    fig.suptitle(f"{r.model_label} on {r.request.devices} x {r.hardware.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lora_plot(r: PlanResult, path: Path, top: int, plt) -> Path:
    cands = r.candidates[:top]
    points = [c.lora for c in cands]
    assert all(p is not None for p in points)  # a LoRA request's candidates carry their LoRA point
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cands) + 2), 4.5))
    ax.bar(range(len(cands)), [p.tok_s_device for p in points if p is not None])
    ax.set_xticks(range(len(cands)))
    ax.set_xticklabels([c.layout.name for c in cands], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("LoRA tokens/s per device")
    ax.set_title(f"{r.model_label} LoRA on {r.request.devices} x {r.hardware.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
