"""`moeswap quantize SRC DST --experts mxfp4|mxfp8|int4|fp8 [--mode even|floor|rceil] [--dense int8|int4]`:
re-store a checkpoint's routed experts as compressed-tensors MXFP4, MXFP8 or INT4, or as DeepSeek block FP8, and
with --dense its large dense matrices (weights.dense_quant's rule) as compressed-tensors INT8 (int-quantized, one
scale per row) or INT4 (pack-quantized, per 32) in a second config group, and report the error that introduces.
The dense codes are the ones `--dense-weights int8|int4` makes at load from the same source, bit for bit.

Streams shard by shard, tensor by tensor (each tensor is read with pread, converted if it is an expert
weight, written and dropped: peak memory is about one tensor), into a temporary sibling renamed to DST
only when everything is written, so a failure leaves no output. A source value that is NaN or infinite
is refused, naming the tensor. Sources: bf16/fp16/fp32, DeepSeek block FP8 (non-expert FP8 weights are
written dequantised to bf16, or copied when the target is block FP8) and compressed-tensors MX or INT4
(same-format experts are copied byte for byte). DST gets a model card of its own (model_card.py: source, date,
formats, errors) in place of the source's.
Entry points: `quantize(src, dst, QuantizeOptions)` and `compare_models` (logit error); the command is
commands/quantize.py.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, writing
from moeswap.formats import compressed_tensors as ct
from moeswap.formats import mx
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from moeswap.formats.files import confined, read_json
from moeswap.formats.writer import layout, write_index, write_shard
from moeswap.model_card import CARD_NAME, is_card, quantize_card
from moeswap.weights import dense_quant, registry
from moeswap.weights.floating import FLOAT
from moeswap.weights.format import WeightFormat
from moeswap.weights.fp8_block import FP8_BLOCK
from moeswap.weights.stored import Declared, StoredWeight, group_modules, storage_of

# Routed experts (K3 / Kimi Linear w1-w3, DeepSeek gate/up/down_proj); `shared_experts.*` never matches.
EXPERT_PATTERN = r"(?:.*\.)?experts\.\d+\.(?:w[123]|gate_proj|up_proj|down_proj)"
REPORT_NAME = "quantization_report.json"
DENSE_DTYPE = torch.bfloat16  # what quantised non-expert weights (block FP8) are written as
FP8 = "fp8"  # --experts fp8: DeepSeek block FP8 (not a compressed-tensors format)
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
EXPERT_CHOICES = (*ct.FORMATS, FP8)


def _short(fmt: str) -> str:
    return FP8 if fmt in (FP8, "fp8_block") else ct.short_name(fmt)


def _label(fmt: str) -> str:
    return "fp8 block 128x128" if fmt == FP8 else ct.FORMATS[fmt]


@dataclass(frozen=True)
class QuantizeOptions:
    experts: str = "mxfp4"  # mxfp4 | mxfp8 | int4 (or the compressed-tensors format names) | fp8 (block FP8)
    mode: str = "even"  # block exponent: even (compressed-tensors) | floor (OCP spec) | rceil
    expert_pattern: str = EXPERT_PATTERN  # full-match regex on module names
    progress: bool = False
    dense: str | None = None  # int8 | int4: the dense weights dense_quant picks, stored so (None: as they are)


def quantize(src: str | os.PathLike, dst: str | os.PathLike, options: QuantizeOptions = QuantizeOptions()) -> dict:
    """Writes DST and returns the report (also saved as DST/quantization_report.json)."""
    fmt = _short(options.experts)
    mx.check_mode(options.mode)
    if options.dense is not None and options.dense not in dense_quant.FORMATS:
        raise ValueError(f"--dense {options.dense!r}: expected one of {', '.join(dense_quant.FORMATS)}")
    if options.dense is not None and fmt == FP8:
        raise ValueError("--dense needs a compressed-tensors expert format (mxfp4, mxfp8, int4): block FP8's config "
                         "cannot declare a second scheme")
    try:
        pattern = re.compile(options.expert_pattern)
    except re.error as err:
        raise ValueError(f"--expert-pattern {options.expert_pattern!r} is not a valid regex: {err}") from None
    src, dst = Path(src), Path(dst)
    raw = _read_config(src)
    extra_files = side_files(src)
    source_card = next((p for p in extra_files if is_card(p.name) and p.is_file()), None)
    extra_files = [p for p in extra_files if not is_card(p.name)]  # the new card is written instead
    _check_destination(src, dst)
    t0 = time.perf_counter()
    with Checkpoint.open(src) as ckpt:
        plan = _Plan.build(ckpt, raw, fmt, pattern, src, options.dense)
        with atomic_directory(dst) as tmp:
            report = plan.write(tmp, options)
            report.update(source=str(src), destination=str(dst), seconds=round(time.perf_counter() - t0, 2))
            with writing(tmp / "config.json"):
                dense = (options.dense, plan.dense_targets) if plan.dense_targets else None
                _write_config(tmp, raw, dict(FP8_CONFIG) if fmt == FP8
                              else ct.quantization_config(fmt, plan.ignore, dense=dense))
            copy_side_files(extra_files, tmp)
            with writing(tmp / REPORT_NAME):
                (tmp / REPORT_NAME).write_text(jsonio.dumps(report, indent=2) + "\n")
            card = source_card.read_text(encoding="utf-8", errors="replace") if source_card is not None else None
            date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
            with writing(tmp / CARD_NAME):
                (tmp / CARD_NAME).write_text(quantize_card(report, card, date), encoding="utf-8")
            Checkpoint.open(tmp).close()  # every header parses and the index resolves
    return report


# -- planning -------------------------------------------------------------------------------------


@dataclass
class _Unit:
    """Source tensors that become output tensors together: one passthrough tensor or one module."""

    outputs: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # output name -> spec
    # "copy" | "keep" (a quantised non-expert module already in the target format) | "encode" | "dequantize" |
    # "dense" (a dense weight encoded in the --dense format)
    action: str
    weight: StoredWeight | None = None


class _Plan:
    def __init__(self, ckpt: Checkpoint, declared: Declared, fmt: str, shards: dict[str, list[_Unit]],
                 ignore: list[str], experts: int, dense_targets: list[str] | None = None, dense: str | None = None):
        self.ckpt, self.declared, self.fmt, self.shards, self.ignore = ckpt, declared, fmt, shards, ignore
        self.target = _target(fmt)  # what the experts are written as
        self.expert_count = experts
        self.dense_targets = dense_targets or []  # the dense group's patterns (config.json)
        self.dense = dense
        self.dense_reported: set[str] = set()

    @classmethod
    def build(cls, ckpt: Checkpoint, raw: dict, fmt: str, pattern: re.Pattern, src: Path,
              dense: str | None = None) -> _Plan:
        declared = Declared.from_config(raw, str(src / "config.json"))
        modules, _ = group_modules(ckpt.names())
        weights = {m: storage_of(ckpt, m, t, declared) for m, t in modules.items()}
        experts = {m for m in weights if pattern.fullmatch(m)}
        if not experts:
            raise ValueError(f"{src}: no routed-expert weights found (module names matching {pattern.pattern!r}, "
                             f"e.g. model.layers.1.block_sparse_moe.experts.0.w1); pass --expert-pattern")
        dense_target = registry.FORMATS[dense_quant.FORMATS[dense]] if dense is not None else None
        quantized = {m for m, w in weights.items() if dense_target is not None and m not in experts
                     and dense_quant.quantizable(m, w.shape(ckpt))}
        owner = {name: m for m, t in modules.items() for name in t.values()}
        shards: dict[str, list[_Unit]] = {}
        placed: set[str] = set()
        by_file: dict[Path, list[str]] = {}
        for name in ckpt.names():
            by_file.setdefault(ckpt.info(name).file, []).append(name)
        for file in ckpt.files():  # each module goes to the shard that holds its first tensor
            units = shards.setdefault(file.name, [])
            for name in sorted(by_file[file], key=lambda n: ckpt.info(n).offset):
                module = owner.get(name)
                if module is None or (module not in experts and module not in quantized
                                      and weights[module].format is FLOAT):
                    info = ckpt.info(name)
                    units.append(_Unit({name: (info.dtype, info.shape)}, "copy"))
                    continue
                if module in placed:
                    continue
                placed.add(module)
                if module in quantized:
                    units.append(cls._dense_unit(ckpt, weights[module], dense_target))
                    continue
                units.append(cls._module_unit(ckpt, weights[module], module in experts, _target(fmt)))
        dense_2d = [m for m, w in weights.items() if m not in experts and m not in quantized
                    and len(w.shape(ckpt)) == 2]
        ignore = ct.ignore_patterns(dense_2d)
        caught = sorted(m for m in experts | quantized if ct.matches(m, ignore))
        if caught:  # cannot happen for names that differ in a non-numeric segment; checked all the same
            raise ValueError(f"{src}: the ignore list built for the unquantised non-expert modules would also "
                             f"match {caught[0]!r}; pass a narrower --expert-pattern")
        targets = ct.ignore_patterns(sorted(quantized))
        caught = sorted(m for m in weights if m not in quantized and ct.matches(m, targets))
        if caught:  # a numbered name quantised in one layer and not in another (shapes differ): not expressible
            raise ValueError(f"{src}: the dense group's targets built for the quantised dense modules would also "
                             f"match {caught[0]!r}, which is not quantised (its shape differs)")
        return cls(ckpt, declared, fmt, shards, ignore, len(experts), targets, dense)

    @staticmethod
    def _dense_unit(ckpt: Checkpoint, weight: StoredWeight, target: WeightFormat) -> _Unit:
        if weight.format is target:  # already stored so: kept byte for byte
            return _Unit({n: (ckpt.info(n).dtype, ckpt.info(n).shape) for n in weight.tensors.values()}, "keep", weight)
        specs = target.stored_specs(weight.shape(ckpt))
        return _Unit({f"{weight.module}.{s}": spec for s, spec in specs.items()}, "dense", weight)

    @staticmethod
    def _module_unit(ckpt: Checkpoint, weight: StoredWeight, is_expert: bool, target: WeightFormat) -> _Unit:
        if not is_expert and weight.format is target:  # block FP8 into block FP8: the config still declares it
            return _Unit({n: (ckpt.info(n).dtype, ckpt.info(n).shape) for n in weight.tensors.values()}, "keep", weight)
        if not is_expert:  # a quantised dense weight: written dequantised (the new config leaves it unquantised)
            return _Unit({f"{weight.module}.weight": (DENSE_DTYPE, weight.shape(ckpt))}, "dequantize", weight)
        if weight.format is target:  # already in the target format: keep the shipped codes
            return _Unit({n: (ckpt.info(n).dtype, ckpt.info(n).shape) for n in weight.tensors.values()}, "copy", weight)
        _check_expert_shape(ckpt, weight, target)
        specs = target.stored_specs(weight.shape(ckpt))
        return _Unit({f"{weight.module}.{s}": spec for s, spec in specs.items()}, "encode", weight)

    def write(self, out: Path, options: QuantizeOptions) -> dict:
        from tqdm import tqdm

        rows: list[dict] = []
        dense_rows: list[dict] = []
        dequantized: list[str] = []
        weight_map: dict[str, str] = {}
        total = 0
        bar = tqdm(total=self.expert_count, desc="experts", unit=" weights", disable=not options.progress)
        for file_name, units in self.shards.items():
            if not units:  # every module of this shard began in an earlier one
                continue
            specs = [(name, dtype, shape) for unit in units for name, (dtype, shape) in unit.outputs.items()]
            by_output = {name: unit for unit in units for name in unit.outputs}
            with writing(out / file_name):
                total += write_shard(out / file_name, specs,
                                 self._produce(specs, by_output, options, rows, bar, dense_rows))
            weight_map.update({name: file_name for name, _, _ in specs})
            dequantized += [u.weight.module for u in units if u.action == "dequantize"]
        bar.close()
        with writing(out / INDEX_NAME):
            write_index(out, weight_map, total)
        report = _report(rows, dequantized, self.fmt, options.mode if self.fmt != FP8 else "amax/448",
                         self.ckpt.total_bytes, total)
        if self.dense is not None:
            report["dense"] = _dense_report(dense_rows, self.dense)
        return report

    def _produce(self, specs, by_output: dict[str, _Unit], options: QuantizeOptions, rows: list,
                 bar, dense_rows: list) -> Iterator[tuple[str, torch.Tensor]]:
        cache: tuple[_Unit | None, dict[str, torch.Tensor]] = (None, {})
        for name, _, _ in layout(specs):
            unit = by_output[name]
            if unit.action == "copy" and unit.weight is None:
                tensor = self.ckpt.read(name)
                self._check_finite(tensor, repr(name))
                yield name, tensor
                continue
            if cache[0] is not unit:
                cache = (unit, self._convert(unit, options, dense_rows if unit.action == "dense" else rows, bar))
            yield name, cache[1][name]

    def _convert(self, unit: _Unit, options: QuantizeOptions, rows: list, bar) -> dict[str, torch.Tensor]:
        weight = unit.weight
        decoded = f"{weight.module!r} (decoded from {weight.kind})"
        if unit.action == "copy":  # same-format expert
            rows.append({"name": weight.module, "shape": list(weight.shape(self.ckpt)), "source": weight.kind,
                         "action": "copied", "rel_error": 0.0, "max_abs_error": 0.0})
            bar.update()
            tensors = {n: self.ckpt.read(n) for n in unit.outputs}
            self._check_finite(weight.format.decode({n.rpartition(".")[2]: t for n, t in tensors.items()},
                                                    torch.float32), decoded)
            return tensors
        if unit.action == "keep":
            tensors = {n: self.ckpt.read(n) for n in unit.outputs}
            self._check_finite(weight.format.decode({n.rpartition(".")[2]: t for n, t in tensors.items()},
                                                    torch.float32), decoded)
            return tensors
        if unit.action == "dense":  # as the loader's --dense-weights does: the fp32 values, encoded
            w = weight.read_float(self.ckpt, torch.float32, self.declared)
            self._check_finite(w, decoded if weight.format is not FLOAT else repr(weight.tensors["weight"]))
            target = registry.FORMATS[dense_quant.FORMATS[self.dense]]
            stored = dense_quant.encode_by_rows(target, w)
            back = target.decode(stored, torch.float32)
            # a unit's tensors of different sizes are not adjacent in the shard (writer.layout): it is converted
            # again, to the same bits, for each run of them; reported once
            if weight.module not in self.dense_reported:
                self.dense_reported.add(weight.module)
                rows.append({"name": weight.module, "shape": list(w.shape), "source": weight.kind,
                             "bytes_in": weight.format.stored_bytes({s: self.ckpt.info(n)
                                                                     for s, n in weight.tensors.items()}),
                             "bytes_out": sum(t.numel() * t.element_size() for t in stored.values()),
                             **_errors(w, back)})
            return {f"{weight.module}.{suffix}": t for suffix, t in stored.items()}
        if unit.action == "dequantize":
            w = weight.read_float(self.ckpt, DENSE_DTYPE, self.declared)
            self._check_finite(w, decoded)
            return {f"{weight.module}.weight": w}
        # Float sources are encoded in their own dtype (bit-identical to compressed-tensors for bf16 inputs);
        # quantised ones from their exact fp32 decoding.
        if weight.format is FLOAT:
            w = self.ckpt.read(weight.tensors["weight"])
            self._check_finite(w, repr(weight.tensors["weight"]))
        else:
            w = weight.read_float(self.ckpt, torch.float32, self.declared)
            self._check_finite(w, decoded)
        stored = self.target.encode(w, options.mode)
        back = self.target.decode(stored, torch.float32)
        rows.append({"name": weight.module, "shape": list(w.shape), "source": weight.kind, "action": "encoded",
                     **_errors(w.float(), back)})
        bar.update()
        return {f"{weight.module}.{suffix}": t for suffix, t in stored.items()}

    def _check_finite(self, t: torch.Tensor, what: str) -> None:
        """A NaN or Inf in the source would be written (as MX scale 0xFF, or as is) and fail only at load,
        looking like a corrupt download of the output: refuse it here, before it is written."""
        if not t.is_floating_point():
            return
        finite = nan = 0
        for chunk in t.reshape(-1).split(1 << 24):  # bounded temporaries for an embedding-sized tensor
            values = chunk.float() if chunk.element_size() == 1 else chunk  # no isfinite for 8-bit floats
            ok = int(torch.isfinite(values).sum())
            finite += ok
            nan += int(torch.isnan(values).sum()) if ok < values.numel() else 0
        if finite == t.numel():
            return
        raise CheckpointError(f"{self.ckpt.root}: tensor {what} has {t.numel() - finite:,} non-finite values "
                              f"({nan:,} NaN, {t.numel() - finite - nan:,} infinite) of {t.numel():,}; the "
                              f"source checkpoint is damaged: re-download or re-convert it (nothing was written)")


def _target(fmt: str) -> WeightFormat:
    return FP8_BLOCK if fmt == FP8 else registry.FORMATS[fmt]


def _check_expert_shape(ckpt: Checkpoint, weight: StoredWeight, target: WeightFormat) -> None:
    shape = weight.shape(ckpt)
    if target is FP8_BLOCK and len(shape) == 2:  # any shape: edge blocks are partial
        return
    if len(shape) != 2 or shape[1] % mx.BLOCK:
        raise ValueError(f"routed expert {weight.module}: shape {list(shape)} cannot be stored as "
                         f"{target.ct_format}: the input (last) dim must be a multiple of {mx.BLOCK}")


def _errors(w: torch.Tensor, q: torch.Tensor) -> dict:
    diff = (q - w).double()
    norm = w.double().norm().item()
    err = diff.norm().item()
    return {"rel_error": err / norm if norm else (0.0 if err == 0 else math.inf),
            "max_abs_error": diff.abs().max().item() if diff.numel() else 0.0}


def _report(rows: list[dict], dequantized: list[str], fmt: str, mode: str, bytes_in: int, bytes_out: int) -> dict:
    encoded = [r for r in rows if r["action"] == "encoded"]
    summary = {"expert_weights": len(rows), "encoded": len(encoded), "copied": len(rows) - len(encoded),
               "bytes_in": bytes_in, "bytes_out": bytes_out}
    if encoded:
        worst = max(encoded, key=lambda r: r["rel_error"])
        summary.update(mean_rel_error=sum(r["rel_error"] for r in encoded) / len(encoded),
                       max_rel_error=worst["rel_error"], worst_tensor=worst["name"],
                       max_abs_error=max(r["max_abs_error"] for r in encoded))
    return {"format": _label(fmt), "mode": mode, "summary": summary,
            "dequantized_to_bf16": dequantized, "tensors": rows}


def _dense_report(rows: list[dict], dense: str) -> dict:
    """The --dense part of the report: per tensor relative RMS error (||Q - W|| / ||W||) and max abs error, and
    the bytes of the encoded weights before and after."""
    summary: dict = {"encoded": len(rows), "bytes_in": sum(r["bytes_in"] for r in rows),
                     "bytes_out": sum(r["bytes_out"] for r in rows)}
    if rows:
        worst = max(rows, key=lambda r: r["rel_error"])
        summary.update(mean_rel_error=sum(r["rel_error"] for r in rows) / len(rows), max_rel_error=worst["rel_error"],
                       worst_tensor=worst["name"], max_abs_error=max(r["max_abs_error"] for r in rows))
    return {"format": ct.FORMATS[dense], "rule": {"in_multiple": dense_quant.IN_MULTIPLE,
                                                  "kept": sorted(dense_quant.KEPT)},
            "summary": summary, "tensors": rows}


# -- files ----------------------------------------------------------------------------------------


def _read_config(src: Path) -> dict:
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: expected a model directory (config.json + safetensors), found "
                                f"{'a file' if src.exists() else 'nothing'}")
    path = confined(src, "config.json", ValueError, str(src))
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing; a model directory needs its config.json")
    raw = read_json(path, ValueError)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    return raw


def _check_destination(src: Path, dst: Path) -> None:
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the destination must differ from the source")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty directory; choose another destination or remove it")


def _write_config(out: Path, raw: dict, qconfig: dict) -> None:
    config = copy.deepcopy(raw)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    holder = text if text is not None and "quantization_config" in text else config
    for d in (config, text or {}):
        d.pop("quantization_config", None)
    holder["quantization_config"] = qconfig
    (out / "config.json").write_text(jsonio.dumps(config, indent=2) + "\n")


# A training output (`moeswap train --mode full`) is a model directory plus the run's record: the record
# describes how the source was made, not what a conversion of it holds
RUN_RECORD = ("manifest.json", "loss.csv", "loss.png", "checkpoints")


def side_files(src: Path) -> list[Path]:
    """Tokenizer, generation config, code: everything but the weights, their index, config.json and a
    training run's record. Each must lie inside `src` (checked before any work): a link outside would copy
    another file into DST."""
    return [confined(src, path.name, ValueError, str(src)) for path in sorted(src.iterdir())
            if path.name not in ("config.json", INDEX_NAME, REPORT_NAME, *RUN_RECORD) and path.suffix != ".safetensors"]


def copy_side_files(side_files: list[Path], out: Path) -> None:
    for path in side_files:
        with writing(out / path.name):
            if path.is_dir():
                shutil.copytree(path, out / path.name, symlinks=True)  # links inside stay links, not copies
            elif path.is_file():
                shutil.copy2(path, out / path.name)


# -- quality --------------------------------------------------------------------------------------


def compare_models(reference: str | os.PathLike, candidate: str | os.PathLike, tokens: int = 64,
                   generate_tokens: int = 32, seed: int = 0, dtype: str = "float32") -> dict:
    """Logit error of `candidate` against `reference` on one random prompt (teacher forced), and how many
    greedy tokens the two generate identically before they first differ. Both must load in moeswap."""
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.models.loader import LoadOptions, load_model

    results = []
    for path in (reference, candidate):
        model, _ = load_model(path, LoadOptions(dtype=dtype))
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
        with torch.no_grad():
            logits = model(ids)[0].float()
            greedy = generate(model, ids[0].tolist(), GenerationConfig(max_tokens=generate_tokens, stop_ids=()))
        results.append((logits, greedy.tokens))
        del model
    (ref, ref_tokens), (cand, cand_tokens) = results
    same_prefix = next((i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b), len(ref_tokens))
    diff = (cand - ref).double()
    return {
        "tokens": tokens, "logit_rel_error": diff.norm().item() / ref.double().norm().item(),
        "logit_max_abs_error": diff.abs().max().item(),
        "top1_agreement": (cand.argmax(-1) == ref.argmax(-1)).double().mean().item(),
        "greedy_tokens": len(ref_tokens), "greedy_identical_prefix": same_prefix,
        "greedy_agreement": sum(a == b for a, b in zip(ref_tokens, cand_tokens)) / max(1, len(ref_tokens)),
    }
