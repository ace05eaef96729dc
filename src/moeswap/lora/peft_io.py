"""Adapters on disk in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, tensors named
`base_model.model.<checkpoint module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], and moeswap's own
fields in `moeswap_adapter.json` beside them (lora.config); loading also takes the module names of
transformers' port (an architecture's `module_aliases`) and PEFT's LoRA of transformers' fused routed experts
(`target_parameters`, lora.fused_experts). An adapter is checked whole before anything is applied. Entry points:
`save_adapter`, `write_adapter`, `read_adapter`, `load_adapter`, `adapter_state_dict`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moeswap import jsonio
from moeswap.atomic_dir import atomic_directory, writing
from moeswap.formats.checkpoint import Checkpoint
from moeswap.formats.files import confined, read_json
from moeswap.formats.writer import layout, write_shard
from moeswap.lora.config import CONFIG_NAME, MOESWAP_NAME, WEIGHTS_NAME, LoRAConfig, base_fingerprint, moeswap_section
from moeswap.lora.fingerprint import check_same_base
from moeswap.lora.fused_experts import FUSED, split_fused
from moeswap.lora.targets import (
    attach_experts,
    expert_alpha,
    freeze,
    lora_modules,
    moe_blocks,
    weight_prefix,
    wrap,
    wrapped_base,
)
from moeswap.models.layers.basic import unadapted
from moeswap.models.layers.expert_lora import ExpertLoRA

PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight")
_EXPERT = re.compile(r"(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>w[123])")


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's names (dense LoRA, then the MoE blocks' expert LoRA)."""
    prefix = PEFT_PREFIX + weight_prefix(model)
    out: dict[str, torch.Tensor] = {}
    for name, lora in lora_modules(model).items():
        out[f"{prefix}{name}.lora_A.weight"] = lora.lora_A.weight.detach()
        out[f"{prefix}{name}.lora_B.weight"] = lora.lora_B.weight.detach()
    for block in moe_blocks(model).values():
        for key, tensor in block.expert_lora_state_dict().items():
            out[prefix + key] = tensor
    return out


def write_adapter(model: nn.Module, directory: str | os.PathLike, base_model: str | None = None,
                  base_fingerprint: dict | None = None) -> None:
    """Writes the three files into `directory` (which must exist; a staging directory: see save_adapter, or a
    training run's, published whole)."""
    config = getattr(model, "lora_config", None)
    tensors = adapter_state_dict(model)
    if config is None or not tensors:
        raise ValueError("this model carries no LoRA adapter to save (attach_lora or load_adapter first)")
    directory = Path(directory)
    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    path = directory / WEIGHTS_NAME
    with writing(path):
        write_shard(path, specs, ((name, tensors[name]) for name, _, _ in layout(specs)))
    for name, content in ((CONFIG_NAME, config.to_peft(base_model)),
                          (MOESWAP_NAME, config.to_moeswap(base_fingerprint))):
        with writing(directory / name):
            (directory / name).write_text(jsonio.dumps(content, indent=2) + "\n")


def save_adapter(model: nn.Module, directory: str | os.PathLike, base_model: str | None = None,
                 base_fingerprint: dict | None = None) -> Path:
    """`write_adapter` into a new directory, all at once (atomic_dir): `directory` must be absent or empty.
    base_model: written as base_model_name_or_path; base_fingerprint: lora.fingerprint(base_dir)."""
    with atomic_directory(directory) as tmp:
        write_adapter(model, tmp, base_model, base_fingerprint)
    return Path(directory)


@dataclass
class Adapter:
    """An adapter read from disk: its parsed config, the raw adapter_config.json, the tensors by PEFT name and
    moeswap's section (moeswap_adapter.json, or older moeswap's key in adapter_config.json; None: made
    elsewhere)."""

    config: LoRAConfig
    raw: dict
    tensors: dict[str, torch.Tensor]
    directory: Path
    ours: dict | None = None

    @property
    def base_fingerprint(self) -> dict | None:
        """The base model's fingerprint the adapter records (None: made elsewhere, e.g. by PEFT)."""
        return base_fingerprint(self.ours)


def read_adapter(directory: str | os.PathLike) -> Adapter:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: expected an adapter directory ({CONFIG_NAME} + {WEIGHTS_NAME}), "
                                f"found {'a file' if directory.exists() else 'nothing'}")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name}: missing; an adapter directory holds {CONFIG_NAME} and "
                                    f"{WEIGHTS_NAME}")
        confined(directory, name, ValueError, str(directory))  # a link out of the directory: refused as for models
    raw = read_json(directory / CONFIG_NAME, ValueError)
    side = None
    if os.path.lexists(directory / MOESWAP_NAME):
        confined(directory, MOESWAP_NAME, ValueError, str(directory))
        side = read_json(directory / MOESWAP_NAME, ValueError)
    ours = moeswap_section(raw, side, str(directory))
    config = LoRAConfig.from_peft(raw, str(directory / CONFIG_NAME), ours)
    with Checkpoint.open(directory / WEIGHTS_NAME) as ckpt:
        tensors = {name: ckpt.read(name) for name in ckpt.names()}
    if not tensors:
        raise ValueError(f"{directory / WEIGHTS_NAME}: holds no tensors")
    for name, t in tensors.items():  # before anything is applied or merged: a NaN would spread into every output
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{directory / WEIGHTS_NAME}: {name} holds NaN or Inf values; the adapter is damaged")
    return Adapter(config, raw, tensors, directory, ours)


@dataclass
class _Plan:
    """Where an adapter's tensors go in one model: Linear module -> (A, B), MoE block -> its expert keys."""

    linears: dict[str, dict[str, torch.Tensor]]
    experts: dict[str, dict[str, torch.Tensor]]


def plan_adapter(model: nn.Module, adapter: Adapter,
                 base_weight: Callable[[str], torch.Tensor | None] | None = None) -> _Plan:
    """Maps every tensor of `adapter` onto `model` (its modules and shapes only: a model built on `meta`
    will do); one ValueError listing what does not fit. base_weight(param name) gives a base weight's values
    (default: the model's parameter), to compare with copies of base weights PEFT saves in adapters.

    The module part of a name is the checkpoint name, weight prefix included (e.g. K3's `language_model.`);
    the module names of transformers' port of the architecture (the model file's MODULE_ALIASES), which
    adapters PEFT saved from that port carry, are taken too. Every key must name a Linear of the model (or a
    routed-expert projection) with shapes that fit. With target_parameters, PEFT's LoRA of transformers'
    fused expert parameters (`...experts[.base_layer].lora_A.weight`) becomes each expert's (lora.fused_experts).
    """
    prefix = weight_prefix(model)
    modules = dict(model.named_modules())
    blocks = moe_blocks(model)
    aliases = _aliases(model)
    problems: list[str] = []
    linears: dict[str, dict[str, torch.Tensor]] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}  # a ParamWrapper's module -> its lora_A / lora_B
    if base_weight is None:
        base_weight = dict(model.named_parameters()).get
    for key, tensor in adapter.tensors.items():
        m = _KEY.fullmatch(key[len(PEFT_PREFIX):]) if key.startswith(PEFT_PREFIX) else None
        if m is None and key.startswith(PEFT_PREFIX):
            base = _base_copy(key[len(PEFT_PREFIX):].removeprefix(prefix), tensor, base_weight, aliases)
            if base is not None:  # PEFT saves targeted embedding layers' base weights; ours match: nothing to do
                if base:
                    problems.append(f"{key}: {base}")
                continue
        if m is None:
            problems.append(f"{key}: not a LoRA tensor name (expected {PEFT_PREFIX}<module>.lora_A.weight or "
                            f".lora_B.weight)")
            continue
        name = m["module"].removeprefix(prefix) if prefix else m["module"]
        if adapter.config.target_parameters and FUSED.fullmatch(name):
            fused.setdefault(name, {})[m["part"]] = tensor
            continue
        e = _EXPERT.fullmatch(name)
        if e is not None and e["block"] in blocks:
            if int(e["expert"]) >= blocks[e["block"]].num_experts:
                problems.append(f"{key}: expert {e['expert']} does not exist ({e['block']} has "
                                f"{blocks[e['block']].num_experts})")
            experts.setdefault(e["block"], {})[f"{name}.{m['part']}.weight"] = tensor
            continue
        target = _resolve(name, modules, aliases)
        if target is None:
            problems.append(f"{key}: the model has no Linear module {name!r}")
            continue
        linears.setdefault(target, {})[m["part"]] = tensor
    for name, pair in linears.items():
        problems += _pair_problems(name, pair, modules[name], adapter.config)
    for name, pair in fused.items():
        problems += _add_fused(name, pair, blocks, aliases, experts)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(f"{adapter.directory}: the adapter does not fit this model "
                         f"({len(problems)} problem{'s' if len(problems) > 1 else ''}): {shown}")
    return _Plan(linears, experts)


def load_adapter(model: nn.Module, directory: str | os.PathLike | Adapter, base_dir: str | os.PathLike | None = None,
                 trainable: bool = False) -> LoRAConfig:
    """Applies the adapter in `directory` (or one read_adapter read) to `model`: unmerged LoRALinear wrappers,
    expert LoRA through the MoE hook. With `base_dir`, an adapter that records a base fingerprint must match
    it. The LoRA tensors require grad only with `trainable` (PEFT's is_trainable); all else stays frozen."""
    adapter = directory if isinstance(directory, Adapter) else read_adapter(directory)
    recorded = adapter.base_fingerprint
    if base_dir is not None and recorded is not None:
        check_same_base(recorded, base_dir, f"adapter {adapter.directory}")
    if lora_modules(model) or getattr(model, "lora_config", None) is not None:
        raise ValueError("this model already carries a LoRA adapter; detach_lora(model) first")
    if getattr(model, "adapter_rows", None) is not None:
        raise ValueError("this model serves LoRA adapters (lora.serving); load this one with them")
    plan = plan_adapter(model, adapter)
    blocks = moe_blocks(model)
    cfg = adapter.config
    for name, tensors in plan.experts.items():  # checked whole before the model is touched
        expert_lora_for(blocks[name], tensors, cfg, device="meta", where=str(adapter.directory))
    experts = {name: _expert_spec(tensors, cfg) for name, tensors in plan.experts.items()}
    base = freeze(model)
    for name, pair in plan.linears.items():
        r, alpha = pair["lora_A"].shape[0], cfg.rank_alpha(name)[1]
        lora = wrap(model, name, r, alpha, cfg.dropout, cfg.use_rslora)
        with torch.no_grad():
            lora.lora_A.weight.copy_(pair["lora_A"])
            lora.lora_B.weight.copy_(pair["lora_B"])
    for name, (projections, r, alpha) in experts.items():
        attach_experts(blocks[name], r, alpha, cfg, projections)
        blocks[name].load_expert_lora_state_dict(plan.experts[name])
    base.update(wrapped_base(model))
    for p in model.parameters():
        p.requires_grad_(trainable and id(p) not in base)
    model.lora_config = cfg
    return cfg


def expert_lora_for(block: nn.Module, tensors: Mapping[str, torch.Tensor], cfg: LoRAConfig, device=None,
                    where: str = "adapter") -> ExpertLoRA:
    """An ExpertLoRA for MoE `block` (not attached) holding the block's adapter tensors (PEFT names without
    the prefix, as plan_adapter gives them); ValueError when they do not fit (a missing expert or projection,
    a shape, per-expert A where the config shares one)."""
    try:
        projections, r, alpha = _expert_spec(tensors, cfg)
        lora = ExpertLoRA(block.num_experts, block.expert_shapes, r, expert_alpha(r, alpha, cfg), cfg.dropout,
                          projections, cfg.expert_shared_a, device=device)
        lora.load_peft_state_dict(block.layer_idx, tensors)
    except ValueError as err:
        raise ValueError(f"{where}: the adapter does not fit this model: {err}") from None
    return lora


def _expert_spec(tensors: dict[str, torch.Tensor], cfg: LoRAConfig) -> tuple[tuple[str, ...], int, float]:
    """(projections, rank, alpha) of one MoE block's expert LoRA from its adapter tensors."""
    projections = tuple(sorted({_EXPERT.fullmatch(_KEY.fullmatch(k)["module"])["proj"] for k in tensors}))
    a_keys = [k for k in tensors if k.endswith("lora_A.weight")]
    if not a_keys:
        raise ValueError(f"{min(tensors)}: routed-expert lora_B without any lora_A")
    first = min(a_keys)
    return projections, tensors[first].shape[0], cfg.rank_alpha(_KEY.fullmatch(first)["module"])[1]


def _add_fused(name: str, pair: dict[str, torch.Tensor], blocks: Mapping[str, nn.Module], aliases,
               experts: dict[str, dict[str, torch.Tensor]]) -> list[str]:
    """Files one fused-expert pair (lora.fused_experts) under its MoE block in `experts`; the problems."""
    module = FUSED.fullmatch(name)["experts"]
    block = next((b for b in (c.removesuffix(".experts") for c in _names(module, aliases)) if b in blocks), None)
    if block is None:
        return [f"{name}: target_parameters LoRA of a module that is no routed-expert set of this model "
                f"(moeswap applies target_parameters to fused routed experts only)"]
    b = blocks[block]
    tensors, problem = split_fused(name, pair, block, b.num_experts, b.expert_shapes)
    if problem is not None:
        return [problem]
    mine = experts.setdefault(block, {})
    if set(tensors) & set(mine):
        return [f"{name}: adapts routed-expert projections of {block} that other tensors of the adapter adapt too"]
    mine.update(tensors)
    return []


def _aliases(model: nn.Module) -> tuple[tuple[str, str], ...]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "arch"):
        return ()
    from moeswap import archs

    return archs.get(config.arch).module_aliases


def _names(name: str, aliases) -> list[str]:
    """`name` (ours), then what it means where it is transformers' name (the architecture's module_aliases)."""
    return [name] + [re.fullmatch(p, name).expand(t) for p, t in aliases if re.fullmatch(p, name)]


def _resolve(name: str, modules: Mapping[str, nn.Module], aliases) -> str | None:
    """The model's Linear that `name` (ours, or transformers' name for it) refers to; one a served-adapter wrapper
    holds counts (lora.serving adds adapters to a model serving others)."""
    for c in _names(name, aliases):
        module = modules.get(c)
        if module is not None and isinstance(unadapted(module), nn.Linear) and ".lora_" not in c:
            return c
    return None


def _base_copy(name: str, tensor: torch.Tensor, base_weight: Callable[[str], torch.Tensor | None],
               aliases) -> str | None:
    """For a copy of a base weight in an adapter (PEFT's `<module>.base_layer.weight` or `<embedding>.weight`,
    saved with embedding-layer targets): "" when it equals the model's weight, a problem when it differs,
    None when `name` is no base weight of the model."""
    if name.endswith(".base_layer.weight"):
        module, attr = name.removesuffix(".base_layer.weight"), "weight"
    else:
        module, _, attr = name.rpartition(".")
    for c in _names(module, aliases):
        param = base_weight(f"{c}.{attr}")
        if param is None:
            continue
        if tuple(param.shape) == tuple(tensor.shape) and torch.equal(param.detach().to(tensor.dtype), tensor):
            return ""
        return (f"replaces the base weight {c}.{attr} with other values; moeswap applies LoRA tensors only "
                f"(was the adapter made on another base?)")
    return None


def _pair_problems(name: str, pair: dict[str, torch.Tensor], module: nn.Linear, config: LoRAConfig) -> list[str]:
    A, B = pair.get("lora_A"), pair.get("lora_B")
    if A is None or B is None:
        return [f"{name}: has {'lora_A' if A is not None else 'lora_B'} without "
                f"{'lora_B' if A is not None else 'lora_A'}"]
    if not (A.dtype.is_floating_point and B.dtype.is_floating_point):
        return [f"{name}: LoRA tensors must be floating point, found {A.dtype} and {B.dtype}"]
    r = config.rank_alpha(name)[0]
    want_A, want_B = (r, module.in_features), (module.out_features, r)
    if tuple(A.shape) != want_A or tuple(B.shape) != want_B:
        return [f"{name}: lora_A {list(A.shape)} / lora_B {list(B.shape)} do not fit a rank-{r} LoRA of a "
                f"{module.in_features} -> {module.out_features} Linear (expected {list(want_A)} / {list(want_B)})"]
    return []
