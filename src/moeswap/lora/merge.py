"""`moeswap merge BASE ADAPTER OUT`: a checkpoint with a LoRA adapter added into its weights.

Each targeted dense weight becomes W + s · B A, computed in fp32 and stored in W's own dtype (the rounding
that storing adds is reported per tensor). Each adapted routed-expert projection is decoded from its stored
format (weights.registry: MXFP4, MXFP8 or float), gets its expert's update (ExpertLoRA.merged_delta) added
in fp32 and is stored again in the same format with the project's codec (compressed-tensors' MX encoding,
`even` block exponents, as `moeswap quantize` writes); the error against the exact W + s · B A is reported
per layer and projection, also relative to the update's size (quantisation to 4 bits can swallow most of a
small update: the report says how much). The base's model card is not copied: OUT gets its own README.md
(model_card.py: base, adapter, date, what was merged). Every other tensor and side file is copied as it
is, shard by shard (a shard without merged tensors is copied whole; one with them is rewritten tensor by
tensor, so peak memory is about one tensor). The adapter is mapped onto the model built on `meta`
(lora.peft_io), so a key or shape that does not fit is refused before anything is written; a recorded base
fingerprint must match BASE. OUT is written all at once (atomic_dir).
Entry points: `merge_checkpoint(base, adapter, out)`, and add_parser / run for the CLI.
"""

from __future__ import annotations

import argparse
import datetime
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, writing
from moeswap.config import load_config
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint
from moeswap.formats.files import confined
from moeswap.formats.writer import layout, write_shard
from moeswap.hub import resolve_model
from moeswap.lora.fingerprint import check_same_base
from moeswap.lora.layer import lora_scaling
from moeswap.lora.peft_io import expert_lora_for, plan_adapter, read_adapter
from moeswap.lora.targets import moe_blocks
from moeswap.model_card import CARD_NAME, is_card, merge_card
from moeswap.models.layers.expert_lora import ExpertLoRA
from moeswap.quantize import copy_side_files, side_files
from moeswap.weights import registry
from moeswap.weights.floating import FLOAT
from moeswap.weights.format import WeightFormat
from moeswap.weights.mxfp4 import MXFP4
from moeswap.weights.mxfp8 import MXFP8

REPORT_NAME = "merge_report.json"
MERGEABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def merge_checkpoint(base: str | Path, adapter_dir: str | Path, out: str | Path, progress: bool = False) -> dict:
    """Writes OUT and returns the report (also OUT/merge_report.json)."""
    from moeswap import archs
    from moeswap.models import build_model

    t0 = time.perf_counter()
    base, out = Path(base), Path(out)
    if not base.is_dir():
        raise FileNotFoundError(f"{base}: expected a model directory (config.json + safetensors), found "
                                f"{'a file' if base.exists() else 'nothing'}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose another destination or remove it")
    config = load_config(base)
    # config.json and the index stay valid (the same names, shapes and shards); the side files as quantize copies
    # them (a training run's record or a quantisation report describes the base, not the merge)
    side = [confined(base, n, ValueError, str(base)) for n in ("config.json", INDEX_NAME)
            if (base / n).exists()] + side_files(base)
    # the base's card describes the base: the merge writes its own (its license lines kept)
    base_card = next((p for p in side if is_card(p.name) and p.is_file()), None)
    side = [p for p in side if not is_card(p.name)]
    adapter = read_adapter(adapter_dir)
    recorded = adapter.base_fingerprint
    if recorded is not None:
        check_same_base(recorded, base, f"adapter {adapter.directory}")
    arch = archs.get(config.arch)
    model = build_model(config, device="meta")  # modules and shapes only
    with Checkpoint.open(base) as ckpt:
        prefix = config.weight_prefix
        # parameter name -> checkpoint name (the map is nearly the identity; see its architecture's checkpoint_map)
        stored = {}
        expert_tensors: dict[tuple[int, int, str], dict[str, str]] = {}  # (layer, expert, proj) -> suffix -> name
        for name in ckpt.names():
            local = name[len(prefix):] if prefix and name.startswith(prefix) else name
            target, m = arch.classify(local)
            if target == "expert":
                layer, expert, proj, kind = arch.expert_key(m)
                expert_tensors.setdefault((layer, expert, proj), {})[kind] = name
            elif target != "skip":
                stored[target] = name

        def base_weight(param: str) -> torch.Tensor | None:
            return ckpt.read(stored[param]) if param in stored else None

        plan = plan_adapter(model, adapter, base_weight)
        experts = _expert_jobs(model, plan, adapter, expert_tensors)
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
        expert_rows: dict[tuple[str, str], list[dict]] = {}
        pending: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}  # merged expert tensors not yet written
        with atomic_directory(out) as tmp:
            for file in ckpt.files():
                names = [n for n in ckpt.names() if ckpt.info(n).file == file]
                target = tmp / file.name
                with writing(target):
                    if not any(n in updates or n in experts for n in names):
                        shutil.copy2(file, target)
                        continue
                    specs = [(n, ckpt.info(n).dtype, ckpt.info(n).shape) for n in names]
                    write_shard(target, specs, _tensors(ckpt, layout(specs), updates, rows, experts, pending,
                                                        expert_rows))
                if progress:
                    print(f"merge: wrote {file.name}", file=sys.stderr)
            copy_side_files(side, tmp)
            report = _report(rows, _expert_summary(expert_rows), base, adapter.directory, out,
                             time.perf_counter() - t0)
            with writing(tmp / REPORT_NAME):
                (tmp / REPORT_NAME).write_text(jsonio.dumps(report, indent=2) + "\n")
            date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
            card = base_card.read_text(encoding="utf-8", errors="replace") if base_card is not None else None
            with writing(tmp / CARD_NAME):
                (tmp / CARD_NAME).write_text(merge_card(report, adapter.raw, card, date), encoding="utf-8")
            Checkpoint.open(tmp).close()  # every header parses and the index resolves
    return report


@dataclass(frozen=True)
class _ExpertJob:
    """One routed-expert projection to merge: its stored tensors (suffix -> checkpoint name), their format,
    and the layer's ExpertLoRA that gives the update."""

    key: tuple[int, int, str]  # layer, expert, projection
    module: str  # e.g. model.layers.1.block_sparse_moe.experts.7.w1
    names: dict[str, str]
    fmt: WeightFormat
    lora: ExpertLoRA


def _expert_jobs(model, plan, adapter, expert_tensors) -> dict[str, _ExpertJob]:
    """Checkpoint name -> the job that rewrites it, for every projection the adapter's expert LoRA adapts;
    ValueError (before anything is written) for tensors that do not fit or a format moeswap cannot write."""
    blocks = moe_blocks(model)
    jobs: dict[str, _ExpertJob] = {}
    for block_name, tensors in plan.experts.items():
        block = blocks[block_name]
        lora = expert_lora_for(block, tensors, adapter.config, where=str(adapter.directory))
        for e in range(block.num_experts):
            for proj in lora.projections:
                key = (block.layer_idx, e, proj)
                names = expert_tensors.get(key)
                module = f"{block_name}.experts.{e}.{proj}"
                if names is None:
                    raise ValueError(f"{module}: the base checkpoint has no tensors for this routed expert")
                fmt = registry.for_suffixes(names)
                if fmt not in (FLOAT, MXFP4, MXFP8):
                    raise ValueError(f"{module}: stored as {sorted(names)}; merging into routed experts of this "
                                     f"format is not supported (float, MXFP4 and MXFP8 are)")
                job = _ExpertJob(key, module, dict(names), fmt, lora)
                jobs.update({n: job for n in names.values()})
    return jobs


def merge_expert(stored: dict[str, torch.Tensor], fmt: WeightFormat, delta: torch.Tensor
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One expert projection's stored tensors with `delta` [O, N] added: decoded, W + delta in fp32, encoded in
    `fmt` again (float: rounded to the stored dtype). Returns the new tensors (the stored dtypes) and the
    error of what they decode to against the exact W + delta, elementwise (fp64)."""
    w = fmt.decode(stored, torch.float32)
    merged = w + delta.float()
    if fmt is FLOAT:
        new = {"weight": merged.to(stored["weight"].dtype)}
    else:
        new = {s: t.view(stored[s].dtype) if t.dtype != stored[s].dtype else t
               for s, t in fmt.encode(merged, "even").items()}
    err = (fmt.decode(new, torch.float64) - (w.double() + delta.double())).abs()
    return new, err


def _tensors(ckpt: Checkpoint, specs, updates: dict, rows: list[dict], experts: dict[str, _ExpertJob],
             pending: dict, expert_rows: dict):
    for name, _, _ in specs:
        job = experts.get(name)
        if job is not None:
            if job.key not in pending:
                delta = job.lora.merged_delta(job.key[2], job.key[1])
                new, err = merge_expert({s: ckpt.read(n) for s, n in job.names.items()}, job.fmt, delta)
                pending[job.key] = {job.names[s]: t for s, t in new.items()}
                layer_proj = (job.module.rsplit(".experts.", 1)[0], job.key[2])
                expert_rows.setdefault(layer_proj, []).append(
                    {"max_abs_update": delta.abs().max().item(), "max_abs_error": err.max().item(),
                     "sum_abs_error": err.sum().item(), "count": err.numel(),
                     "err_sq": err.square().sum().item(), "update_sq": delta.double().square().sum().item(),
                     "format": job.fmt.name})
            w = pending[job.key].pop(name)
            if not pending[job.key]:
                del pending[job.key]
            yield name, w
            continue
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


def _expert_summary(expert_rows: dict[tuple[str, str], list[dict]]) -> list[dict]:
    """Per MoE layer and projection, over its experts: the largest update and error, the mean error, and the
    error's norm relative to the update's (how much of the update the re-quantisation blurs)."""
    out = []
    for (block, proj), rs in sorted(expert_rows.items()):
        update_sq = sum(r["update_sq"] for r in rs)
        out.append({"layer": block, "projection": proj, "format": rs[0]["format"], "experts": len(rs),
                    "max_abs_update": max(r["max_abs_update"] for r in rs),
                    "max_abs_error": max(r["max_abs_error"] for r in rs),
                    "mean_abs_error": sum(r["sum_abs_error"] for r in rs) / sum(r["count"] for r in rs),
                    "error_over_update": (sum(r["err_sq"] for r in rs) / update_sq) ** 0.5 if update_sq else None})
    return out


def _report(rows: list[dict], experts: list[dict], base: Path, adapter: Path, out: Path, seconds: float) -> dict:
    weights = sum(e["experts"] for e in experts)
    ratios = [e["error_over_update"] for e in experts if e["error_over_update"] is not None]
    return {"base": str(base), "adapter": str(adapter), "destination": str(out), "seconds": round(seconds, 2),
            "merged_tensors": len(rows),
            "max_abs_rounding": max((r["max_abs_rounding"] for r in rows), default=0.0),
            "mean_abs_rounding": sum(r["mean_abs_rounding"] for r in rows) / len(rows) if rows else 0.0,
            "tensors": rows,
            "merged_expert_weights": weights,
            "expert_max_abs_error": max((e["max_abs_error"] for e in experts), default=0.0),
            "expert_mean_abs_error": (sum(e["mean_abs_error"] * e["experts"] for e in experts) / weights
                                      if weights else 0.0),
            "expert_max_error_over_update": max(ratios, default=None),
            "experts": experts}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("merge", help="add a LoRA adapter (PEFT format) into a checkpoint's weights")
    p.add_argument("base", type=resolve_model,
                   help="base model directory, or a Hugging Face name ORG/NAME[@REVISION] from its cache")
    p.add_argument("adapter", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("out", help="output directory (must not exist or be empty)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    report = merge_checkpoint(args.base, args.adapter, args.out, progress=sys.stderr.isatty())
    if args.json:
        print(jsonio.dumps(report, indent=2))
    else:
        experts = ""
        if report["merged_expert_weights"]:
            ratio = report["expert_max_error_over_update"]
            experts = (f"; {report['merged_expert_weights']} routed-expert weights re-encoded, error max "
                       f"{report['expert_max_abs_error']:.3g}, mean {report['expert_mean_abs_error']:.3g}"
                       + (f" (up to {ratio:.2g}x the update's norm)" if ratio is not None else ""))
        print(f"merged {report['merged_tensors']} dense weights of {args.adapter} into {args.out} in "
              f"{report['seconds']:.1f}s; rounding to the stored dtype: max {report['max_abs_rounding']:.3g}, "
              f"mean {report['mean_abs_rounding']:.3g}{experts} (details in {REPORT_NAME})")
    return 0
