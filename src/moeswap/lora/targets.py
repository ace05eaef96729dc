"""Which modules a LoRA adapter targets, and putting the adapter on a model and taking it off.

Names are the model's module names, which are its checkpoint names (without the checkpoint's weight
prefix, e.g. K3's `language_model.`). Targets are nn.Linear layers (dense MLP, shared experts, KDA and MLA
projections, K3's latent projections, lm_head) and routed-expert projections, named as the checkpoint
names them (`model.layers.1.block_sparse_moe.experts.0.w1`); routed experts are not modules here, their
LoRA goes through the MoE block's expert hook (`MoE.attach_expert_lora`). Everything else is frozen,
the router included. Entry points: `attach_lora(model, config)`, `detach_lora(model)`, `lora_modules(model)`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from moeswap.lora.config import LoRAConfig
from moeswap.lora.layer import LoRALinear
from moeswap.ops.kernel_abi import EXPERT_PROJS

EXPERT_PROJECTIONS = EXPERT_PROJS  # csrc/cpu_kernels.h MOESWAP_EXPERT_PROJS


@dataclass
class Targets:
    linears: list[str] = field(default_factory=list)  # module names, in model order
    experts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # MoE block name -> projections


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """MoE blocks by module name (what routed-expert names hang under)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "num_experts") and hasattr(m, "gate")}


def weight_prefix(model: nn.Module) -> str:
    """The prefix the model's checkpoint puts before its module names (K3: `language_model.`)."""
    return getattr(getattr(model, "config", None), "weight_prefix", "") or ""


def expert_name(block: str, expert: int, projection: str) -> str:
    return f"{block}.experts.{expert}.{projection}"


def matches(targets: tuple[str, ...] | str, name: str, prefix: str = "") -> bool:
    """PEFT's rule: a regex full-matches the name (here also the name with the checkpoint's prefix);
    a list entry equals the name or is a suffix of it after a dot."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None or (
            bool(prefix) and re.fullmatch(targets, prefix + name) is not None)
    return any(name == t or name.endswith("." + t) for t in targets)


def resolve_targets(model: nn.Module, targets: tuple[str, ...] | str, prefix: str | None = None) -> Targets:
    """The Linear modules and routed-expert projections `targets` selects; a ValueError when a pattern
    selects nothing, selects a module that is not a Linear, or some but not all experts of a projection.
    prefix: the checkpoint's weight prefix, which a regex may include (default: the model's)."""
    prefix = weight_prefix(model) if prefix is None else prefix
    found = Targets()
    used: set[str] = set()
    entries = (targets,) if isinstance(targets, str) else tuple(targets)

    def hit(name: str) -> bool:
        got = [t for t in entries if matches(t if isinstance(targets, str) else (t,), name, prefix)]
        used.update(got)
        return bool(got)

    others = []
    for name, module in model.named_modules():
        if not name or isinstance(module, LoRALinear) or _inside_lora(name, model):
            continue
        if isinstance(module, nn.Linear):
            if hit(name):
                found.linears.append(name)
        elif hit(name):
            others.append(f"{name} ({type(module).__name__})")
    if others:
        raise ValueError(f"LoRA targets select modules that are not Linear layers: {', '.join(others[:4])}"
                         + (f" and {len(others) - 4} more" if len(others) > 4 else "")
                         + "; name the projections inside them")
    for block_name, block in moe_blocks(model).items():
        chosen = []
        for proj in EXPERT_PROJECTIONS:
            n = sum(hit(expert_name(block_name, e, proj)) for e in range(block.num_experts))
            if n == block.num_experts:
                chosen.append(proj)
            elif n:
                raise ValueError(f"LoRA targets select {n} of the {block.num_experts} routed experts' {proj} in "
                                 f"{block_name}: routed-expert LoRA applies to every expert of a layer")
        if chosen:
            found.experts[block_name] = tuple(chosen)
    unused = [t for t in entries if t not in used]
    if unused:
        raise ValueError(f"LoRA target {unused[0]!r} matches no module of this model; "
                         f"candidates: {', '.join(_candidates(model, unused[0]))}")
    return found


def attach_lora(model: nn.Module, config: LoRAConfig, generator: torch.Generator | None = None,
                owned: Callable[[int], Sequence[int]] | None = None) -> Targets:
    """Freezes every parameter of `model`, then wraps each targeted Linear in a LoRALinear (PEFT's init:
    A kaiming-uniform from `generator`, B zeros) and gives each targeted MoE block its expert LoRA.
    Only the adapter's parameters require grad afterwards. Returns what was targeted. owned: an MoE
    layer's experts whose expert-LoRA rows to build (expert parallelism: the rank's own, with the values
    the whole LoRA has there); None: every expert's."""
    if lora_modules(model) or getattr(model, "lora_config", None) is not None:
        raise ValueError("this model already carries a LoRA adapter; detach_lora(model) first")
    if getattr(model, "adapter_rows", None) is not None:
        raise ValueError("this model serves LoRA adapters (lora.serving); attach to a model without them")
    targets = resolve_targets(model, config.target_modules)
    blocks = moe_blocks(model)
    base = freeze(model)
    for name in targets.linears:
        r, alpha = config.rank_alpha(name)
        wrap(model, name, r, alpha, config.dropout, config.use_rslora, generator)
    for name, projections in targets.experts.items():
        r, alpha = config.rank_alpha(expert_name(name, 0, projections[0]))
        attach_experts(blocks[name], r, alpha, config, projections, generator,
                       None if owned is None else owned(blocks[name].layer_idx))
    base.update(wrapped_base(model))
    for p in model.parameters():
        p.requires_grad_(id(p) not in base)
    model.lora_config = config
    return targets


def wrapped_base(model: nn.Module) -> dict[int, nn.Parameter]:
    """The LoRA wrappers' base parameters by id: a base kept as codes (block FP8, INT8, INT4) gets a decoded
    `weight` when wrapped, new to the model and frozen all the same."""
    return {id(p): p for m in lora_modules(model).values() for p in (m.weight, m.bias) if p is not None}


def freeze(model: nn.Module) -> dict[int, nn.Parameter]:
    """Every parameter of `model` stops requiring grad; returns them by id (what an adapter adds is the rest).
    The parameters themselves are held, not just their ids: wrapping a base kept as codes drops its code tensors
    from the model, and a freed parameter's id could come back as a new adapter tensor's."""
    for p in model.parameters():
        p.requires_grad_(False)
    return {id(p): p for p in model.parameters()}


def attach_experts(block: nn.Module, r: int, alpha: float, config: LoRAConfig, projections: tuple[str, ...],
                   generator: torch.Generator | None = None, experts: Sequence[int] | None = None) -> None:
    """The block's expert LoRA (MoE.attach_expert_lora: per-expert A and B, or one A shared by the experts;
    experts: only these experts' rows)."""
    block.attach_expert_lora(r, expert_alpha(r, alpha, config), config.dropout, projections=projections,
                             shared_a=config.expert_shared_a, generator=generator, experts=experts)


def expert_alpha(r: int, alpha: float, config: LoRAConfig) -> float:
    """The alpha to give the expert LoRA (whose scaling is alpha / r) for this config's scaling: rsLoRA's
    alpha / sqrt(r) is alpha * sqrt(r) / r."""
    return alpha * r ** 0.5 if config.use_rslora else alpha


def wrap(model: nn.Module, name: str, r: int, alpha: float, dropout: float, use_rslora: bool,
         generator: torch.Generator | None = None) -> LoRALinear:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    base = getattr(parent, attr)
    lora = LoRALinear.from_base(base, r, alpha, dropout, use_rslora, generator).train(base.training)
    setattr(parent, attr, lora)
    return lora


def detach_lora(model: nn.Module, merge: bool = False) -> None:
    """Puts the original Linears back (with the update added into their weights when `merge`) and removes
    the routed-expert LoRA. Parameters stay frozen."""
    experts = [block for block in moe_blocks(model).values() if has_expert_lora(block)]
    if experts and merge:
        raise ValueError("merging routed-expert LoRA into a loaded model is not supported (routed experts are "
                         "read from the checkpoint; `moeswap merge BASE ADAPTER OUT` writes them re-quantised)")
    for name, lora in lora_modules(model).items():
        if merge:
            lora.merge()
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, lora.unwrap())
    for block in experts:
        block.detach_expert_lora()
    model.lora_config = None


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that require grad (after attach_lora: the LoRA A and B tensors), by name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def has_expert_lora(block: nn.Module) -> bool:
    return block._modules.get("expert_lora") is not None


def _inside_lora(name: str, model: nn.Module) -> bool:
    """lora_A / lora_B of an existing wrapper are Linears too, never targets."""
    return ".lora_" in name


def _candidates(model: nn.Module, wanted: str, n: int = 8) -> list[str]:
    """Target names this model has, the ones nearest `wanted` first."""
    leaves = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)
              and not _inside_lora(name, model)}
    leaves.discard("")
    if moe_blocks(model):
        leaves.update(EXPERT_PROJECTIONS)
    leaves = sorted(leaves)
    near = difflib.get_close_matches(wanted.rpartition(".")[2], leaves, n=n, cutoff=0.5)
    return near + [x for x in leaves if x not in near][: max(0, n - len(near))]
