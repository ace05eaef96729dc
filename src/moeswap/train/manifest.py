"""A run's record, written beside its output: manifest.json (what went in, where it ran, what came out),
loss.csv and loss.png, published together with the result so that a run whose manifest is there is finished
and complete. Entry points: `fingerprint(model_dir)`, `publish`, `write_record`, `read_manifest`,
`check_reproduction`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, atomic_file, move_into
from moeswap.procfs import cpu_model, memory_total_bytes

MANIFEST, LOSS_CSV, LOSS_PNG = "manifest.json", "loss.csv", "loss.png"
RESULT_STAGING = ".result"  # inside the output directory, while the result is written
FORMAT = 1
PACKAGES = ("moeswap", "torch", "numpy", "safetensors", "tokenizers", "tiktoken", "jinja2", "pyyaml", "peft",
            "transformers")


# ----------------------------------------------------------------------------------------------------
# What went in


def fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """The base model's identity, moeswap.lora's (adapters record the same one); two bases are the same
    when their `digest`s are."""
    from moeswap.lora import fingerprint as base_fingerprint

    return base_fingerprint(model_dir)


def environment() -> dict[str, Any]:
    """Package versions and the hardware the run had."""
    import torch

    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    hardware = {"cpu": cpu_model(), "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                "torch_threads": torch.get_num_threads(), "os": platform.platform(),
                "memory_bytes": memory_total_bytes()}
    if torch.cuda.is_available():
        hardware["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"packages": versions, "hardware": hardware, "argv": sys.argv}


# ----------------------------------------------------------------------------------------------------
# What came out


def publish(out_dir: Path, write_result: Callable[[Path], list[str]], manifest: dict[str, Any]) -> list[str]:
    """Writes the result (`write_result(directory) -> file names`) and the record into a staging directory
    inside out_dir (complete or absent: atomic_dir), then moves them into out_dir, manifest.json last.
    Returns the files published."""
    staging = Path(out_dir) / RESULT_STAGING
    shutil.rmtree(staging, ignore_errors=True)  # from a run killed while publishing (resumed from a checkpoint)
    with atomic_directory(staging) as tmp:
        files = write_result(tmp)
        write_record(tmp, {**manifest, "files": files})
    return move_into(staging, out_dir, last=MANIFEST)


def write_record(out_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """manifest.json, loss.csv and (with matplotlib) loss.png in out_dir; returns the files written.

    The manifest says what went in (the base model's fingerprint, the data files' SHA-256 and sample
    counts, the full resolved config, the seed), where it ran (package versions, CPU, cores, threads) and what
    came out (wall time, tokens/s, peak RSS, expert-store statistics, the loss curve, eval loss before and
    after). `check_reproduction` compares a new run's curve with a manifest's (`moeswap train --reproduce`).
    """
    out_dir = Path(out_dir)
    with atomic_file(out_dir / LOSS_CSV) as f:
        f.write(loss_csv(manifest["curve"], manifest["eval"]).encode())
    written = [LOSS_CSV]
    png = loss_png(out_dir / LOSS_PNG, manifest["curve"], manifest["eval"])
    if png is not None:
        written.append(LOSS_PNG)
    record = {**manifest, "files": sorted([*manifest.get("files", []), *written, MANIFEST])}
    with atomic_file(out_dir / MANIFEST) as f:
        f.write(jsonio.dumps(record, indent=1).encode())
    return written + [MANIFEST]


def loss_csv(curve: list[dict[str, Any]], evals: list[dict[str, Any]]) -> str:
    """loss.csv: the header, the eval before training (step 0) when there is one, then a row per step."""
    eval_at = {e["step"]: e["loss"] for e in evals}
    lines = ["step,lr,loss,tokens,eval_loss"]
    if 0 in eval_at:
        lines.append(f"0,,,,{eval_at[0]!r}")
    lines += [loss_csv_row(point, eval_at.get(point["step"])) for point in curve]
    return "\n".join(lines) + "\n"


def loss_csv_row(point: dict[str, Any], eval_loss: float | None) -> str:
    """One step's row (no newline): a curve point and the eval loss at its step, if one ran there."""
    return (f"{point['step']},{point['lr']!r},{point['loss']!r},{point['tokens']},"
            + ("" if eval_loss is None else repr(eval_loss)))


def loss_png(path: Path, curve: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Path | None:
    """The training and eval loss against the step; None without matplotlib (the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([p["step"] for p in curve], [p["loss"] for p in curve], label="train", linewidth=1)
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per target token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------------------------------
# Reproduction


def read_manifest(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: no such manifest") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not a JSON manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("config"), dict) \
            or not isinstance(data.get("curve"), list):
        raise ValueError(f"{p}: not a moeswap train manifest (format {FORMAT}, with config and curve)")
    return data


def check_reproduction(old: dict[str, Any], new: dict[str, Any], tolerance: float = 0.0) -> tuple[bool, str]:
    """Whether `new`'s loss curve (and eval losses) match `old`'s: every value within `tolerance`
    (absolute; 0 asks for identical floats). The message names the first difference or the largest gap."""
    pairs = [(f"step {a['step']} loss", a["loss"], b["loss"]) for a, b in zip(old["curve"], new["curve"])]
    pairs += [(f"eval at step {a['step']}", a["loss"], b["loss"]) for a, b in zip(old["eval"], new["eval"])]
    if len(old["curve"]) != len(new["curve"]) or len(old["eval"]) != len(new["eval"]):
        return False, (f"the curves differ in length: {len(old['curve'])} steps and {len(old['eval'])} evals "
                       f"recorded, {len(new['curve'])} and {len(new['eval'])} now")
    worst = max((abs(a - b) for _, a, b in pairs), default=0.0)
    for what, a, b in pairs:
        if abs(a - b) > tolerance:
            return False, (f"{what}: recorded {a!r}, now {b!r} (largest difference {worst:.3g}; "
                           f"tolerance {tolerance:g})")
    return True, (f"{len(old['curve'])} steps and {len(old['eval'])} evals reproduced "
                  + ("exactly" if worst == 0 else f"within {worst:.3g}"))
