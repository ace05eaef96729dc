"""`moeswap merge BASE ADAPTER OUT`: a checkpoint with a LoRA adapter added into its weights.

Each targeted dense weight becomes W + s · B A, computed in fp32 and stored in W's own dtype (the rounding
that storing adds is reported per tensor); every other tensor and side file is copied as it is, shard by
shard (a shard without merged tensors is copied whole; one with them is rewritten tensor by tensor, so peak
memory is about one tensor). The adapter is mapped onto the model built on `meta` (lora.peft_io), so a key
or shape that does not fit is refused before anything is written; a recorded base fingerprint must match
BASE. OUT is written all at once (atomic_dir). Routed-expert LoRA is refused for now (see merge_checkpoint).
Entry points: `merge_checkpoint(base, adapter, out)`, and add_parser / run for the CLI.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, writing
from moeswap.config import load_config
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint
from moeswap.formats.files import confined
from moeswap.formats.writer import layout, write_shard
from moeswap.lora.config import base_fingerprint
from moeswap.lora.fingerprint import check_same_base
from moeswap.lora.layer import lora_scaling
from moeswap.lora.peft_io import plan_adapter, read_adapter

REPORT_NAME = "merge_report.json"
MERGEABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def merge_checkpoint(base: str | Path, adapter_dir: str | Path, out: str | Path, progress: bool = False) -> dict:
    """Writes OUT and returns the report (also OUT/merge_report.json)."""
    from moeswap.models import build_model
    from moeswap.models.loader import checkpoint_map_module

    t0 = time.perf_counter()
    base, out = Path(base), Path(out)
    if not base.is_dir():
        raise FileNotFoundError(f"{base}: expected a model directory (config.json + safetensors), found "
                                f"{'a file' if base.exists() else 'nothing'}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose another destination or remove it")
    config = load_config(base)
    adapter = read_adapter(adapter_dir)
    recorded = base_fingerprint(adapter.raw)
    if recorded is not None:
        check_same_base(recorded, base, f"adapter {adapter.directory}")
    arch = checkpoint_map_module(config)
    model = build_model(config, device="meta")  # modules and shapes only
    with Checkpoint.open(base) as ckpt:
        prefix = config.weight_prefix
        # parameter name -> checkpoint name (the map is nearly the identity; see the model's CHECKPOINT_MAP)
        stored = {}
        for name in ckpt.names():
            local = name[len(prefix):] if prefix and name.startswith(prefix) else name
            target, _ = arch.classify(local)
            if target not in ("expert", "skip"):
                stored[target] = name

        def base_weight(param: str) -> torch.Tensor | None:
            return ckpt.read(stored[param]) if param in stored else None

        plan = plan_adapter(model, adapter, base_weight)
        if plan.experts:
            # TODO(expert formats): re-quantise each merged expert with the project's codec (quantize.py) and
            # report the error, once the MoE block's expert LoRA and format objects exist
            raise ValueError(f"{adapter.directory}: the adapter has routed-expert LoRA ({next(iter(plan.experts))}); "
                             f"merging it (re-quantising the experts) is not supported yet")
        cfg = adapter.config
        updates: dict[str, tuple[str, torch.Tensor]] = {}  # checkpoint name -> (module, delta fp32)
        for module, pair in plan.linears.items():
            name = stored.get(f"{module}.weight")
            if name is None:
                raise ValueError(f"{base}: no stored weight for {module}")
            dtype = ckpt.info(name).dtype
            if dtype not in MERGEABLE or any(f"{name}{s}" in ckpt for s in ("_scale", "_scale_inv", "_packed")):
                raise ValueError(f"{name} is stored quantised ({dtype} with scales): merging into quantised dense "
                                 f"weights is not supported")
            r, alpha = pair["lora_A"].shape[0], cfg.rank_alpha(module)[1]
            scale = lora_scaling(r, alpha, cfg.use_rslora)
            updates[name] = (module, (pair["lora_B"].float() @ pair["lora_A"].float()) * scale)
        rows: list[dict] = []
        with atomic_directory(out) as tmp:
            for file in ckpt.files():
                names = [n for n in ckpt.names() if ckpt.info(n).file == file]
                target = tmp / file.name
                with writing(target):
                    if not any(n in updates for n in names):
                        shutil.copy2(file, target)
                        continue
                    specs = [(n, ckpt.info(n).dtype, ckpt.info(n).shape) for n in names]
                    write_shard(target, specs, _tensors(ckpt, layout(specs), updates, rows))
                if progress:
                    print(f"merge: wrote {file.name}", file=sys.stderr)
            _copy_side_files(base, tmp, {f.name for f in ckpt.files()})
            report = _report(rows, base, adapter.directory, out, time.perf_counter() - t0)
            with writing(tmp / REPORT_NAME):
                (tmp / REPORT_NAME).write_text(jsonio.dumps(report, indent=2) + "\n")
            Checkpoint.open(tmp).close()  # every header parses and the index resolves
    return report


def _tensors(ckpt: Checkpoint, specs, updates: dict, rows: list[dict]):
    for name, _, _ in specs:
        w = ckpt.read(name)
        if name in updates:
            module, delta = updates[name]
            exact = w.double() + delta.double()
            w = (w.float() + delta).to(w.dtype)
            err = (w.double() - exact).abs()
            rows.append({"tensor": name, "module": module, "dtype": str(w.dtype).removeprefix("torch."),
                         "max_abs_update": delta.abs().max().item(), "max_abs_rounding": err.max().item(),
                         "mean_abs_rounding": err.mean().item()})
        yield name, w


def _copy_side_files(base: Path, out: Path, shards: set[str]) -> None:
    """config.json, the index, tokenizer files and the rest: everything but the shards, as they are."""
    for path in sorted(base.iterdir()):
        if path.name in shards or path.name == REPORT_NAME:
            continue
        src = confined(base, path.name, ValueError, str(base))
        with writing(out / path.name):
            if src.is_dir():
                shutil.copytree(src, out / path.name, symlinks=True)
            elif src.is_file():
                shutil.copy2(src, out / path.name)


def _report(rows: list[dict], base: Path, adapter: Path, out: Path, seconds: float) -> dict:
    return {"base": str(base), "adapter": str(adapter), "destination": str(out), "seconds": round(seconds, 2),
            "merged_tensors": len(rows),
            "max_abs_rounding": max((r["max_abs_rounding"] for r in rows), default=0.0),
            "mean_abs_rounding": sum(r["mean_abs_rounding"] for r in rows) / len(rows) if rows else 0.0,
            "tensors": rows}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("merge", help="add a LoRA adapter (PEFT format) into a checkpoint's weights")
    p.add_argument("base", help="base model directory")
    p.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    report = merge_checkpoint(args.base, args.adapter, args.out, progress=sys.stderr.isatty())
    if args.json:
        print(jsonio.dumps(report, indent=2))
    else:
        print(f"merged {report['merged_tensors']} dense weights of {args.adapter} into {args.out} in "
              f"{report['seconds']:.1f}s; rounding to the stored dtype: max {report['max_abs_rounding']:.3g}, "
              f"mean {report['mean_abs_rounding']:.3g} (details in {REPORT_NAME})")
    return 0
