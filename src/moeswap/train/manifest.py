"""A run's record, written beside its output: manifest.json, loss.csv and loss.png.

The manifest says what went in (the base model's fingerprint, the data files' SHA-256 and sample
counts, the full resolved config, the seed), where it ran (package versions, CPU, cores, threads) and what
came out (wall time, tokens/s, peak RSS, expert-store statistics, the loss curve, eval loss before and
after). `check_reproduction` compares a new run's curve with a manifest's (`moeswap train --reproduce`).
Entry points: `fingerprint(model_dir)`, `write_record`, `read_manifest`, `check_reproduction`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from moeswap import jsonio
from moeswap.atomic_dir import atomic_file

MANIFEST, LOSS_CSV, LOSS_PNG = "manifest.json", "loss.csv", "loss.png"
FORMAT = 1
SAMPLED_TENSORS = 8  # tensors hashed for a fingerprint, spread over the sorted names
SAMPLED_BYTES = 1 << 20  # of each: the first and the last MiB
PACKAGES = ("moeswap", "torch", "numpy", "safetensors", "tokenizers", "tiktoken", "jinja2", "pyyaml", "peft",
            "transformers")


# ----------------------------------------------------------------------------------------------------
# What went in


def fingerprint(model_dir: str | Path) -> dict[str, Any]:
    """The base model's identity: moeswap.lora's fingerprint where this build has it (adapters carry the
    same one), else this module's with the same contract: config.json's hash, the index's (or the shard
    headers') hash, and hashes of sampled tensors' bytes, combined into one `sha256`."""
    try:
        lora = importlib.import_module("moeswap.lora")
    except ModuleNotFoundError:
        lora = None
    if lora is not None and hasattr(lora, "fingerprint"):
        return lora.fingerprint(model_dir)
    return own_fingerprint(model_dir)


def own_fingerprint(model_dir: str | Path) -> dict[str, Any]:
    from moeswap.formats.checkpoint import INDEX_NAME, HEADER_LENGTH_BYTES, Checkpoint

    d = Path(model_dir)
    ckpt = Checkpoint.open(d)
    try:
        index = d / INDEX_NAME
        if index.is_file():
            index_sha = _sha256_bytes(index.read_bytes())
        else:  # one file: its header is the index
            h = hashlib.sha256()
            for file in ckpt.files():
                with open(file, "rb") as f:
                    n = int.from_bytes(f.read(HEADER_LENGTH_BYTES), "little")
                    h.update(f.read(n))
            index_sha = h.hexdigest()
        names = sorted(ckpt.names())
        step = max(1, len(names) // SAMPLED_TENSORS)
        tensors = {}
        for name in names[::step][:SAMPLED_TENSORS]:
            info = ckpt.info(name)
            with open(info.file, "rb") as f:
                h = hashlib.sha256()
                f.seek(info.offset)
                h.update(f.read(min(info.nbytes, SAMPLED_BYTES)))
                if info.nbytes > SAMPLED_BYTES:
                    f.seek(info.offset + max(SAMPLED_BYTES, info.nbytes - SAMPLED_BYTES))
                    h.update(f.read(SAMPLED_BYTES))
            tensors[name] = h.hexdigest()
    finally:
        ckpt.close()
    parts = {"method": "moeswap.train", "config_sha256": _sha256_bytes((d / "config.json").read_bytes()),
             "index_sha256": index_sha, "tensors_sha256": tensors}
    return {**parts, "sha256": _sha256_bytes(jsonio.dumps(parts, sort_keys=True).encode())}


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def environment() -> dict[str, Any]:
    """Package versions and the hardware the run had."""
    import torch

    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hardware = {"cpu": cpu, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                "torch_threads": torch.get_num_threads(), "os": platform.platform(),
                "memory_bytes": _memory_total()}
    if torch.cuda.is_available():
        hardware["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"packages": versions, "hardware": hardware, "argv": sys.argv}


def _memory_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int | None:
    """This process's high-water resident memory (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return None


# ----------------------------------------------------------------------------------------------------
# What came out


def write_record(out_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """manifest.json, loss.csv and (with matplotlib) loss.png in out_dir; returns the files written."""
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
    eval_at = {e["step"]: e["loss"] for e in evals}
    lines = ["step,lr,loss,tokens,eval_loss"]
    if 0 in eval_at:
        lines.append(f"0,,,,{eval_at[0]!r}")
    for point in curve:
        ev = eval_at.get(point["step"])
        lines.append(f"{point['step']},{point['lr']!r},{point['loss']!r},{point['tokens']},"
                     + ("" if ev is None else repr(ev)))
    return "\n".join(lines) + "\n"


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
