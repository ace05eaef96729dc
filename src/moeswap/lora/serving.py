"""Several LoRA adapters on one model at once, each request with its own (`serve --lora NAME=PATH`,
`generate --lora`): adapter i is slot i + 1, slot 0 the base model. Every adapter is read and checked (base
fingerprint, then its tensors against the modules) before any is applied; dense targets are wrapped in
lora.multi.MultiLoRALinear, routed-expert LoRA goes into the blocks' ExpertLoRASlots, projections are fused
first (the C decode step reads the fused weights through the wrappers). No dropout.
Entry points: `read_adapters`, `load_adapters` -> ServedAdapters.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from moeswap.lora.fingerprint import check_same_base
from moeswap.lora.layer import lora_scaling
from moeswap.lora.multi import AdapterRows, MultiLoRALinear
from moeswap.lora.peft_io import Adapter, expert_lora_for, plan_adapter, read_adapter
from moeswap.lora.targets import lora_modules, moe_blocks
from moeswap.models.layers.basic import fuse_projections

SERVE_HOOK = "serve_expert_lora"  # MoE blocks that take served routed-expert LoRA


@dataclass(frozen=True)
class ServedAdapters:
    """The adapters a model serves: names[i] and directories[i] are slot i + 1; `rows` is the model's
    row -> slot context (also `model.adapter_rows`), which the scheduler sets around each forward."""

    names: tuple[str, ...]
    directories: tuple[Path, ...]
    rows: AdapterRows

    def slot(self, name: str) -> int | None:
        """The slot serving `name`, or None."""
        try:
            return self.names.index(name) + 1
        except ValueError:
            return None


def read_adapters(named: Sequence[tuple[str, str | os.PathLike]], base_dir: str | os.PathLike
                  ) -> list[tuple[str, Adapter]]:
    """Reads each (name, directory) and checks a recorded base fingerprint against `base_dir` (an adapter
    PEFT made records none); names must be distinct. ValueError / FileNotFoundError naming the adapter."""
    seen: set[str] = set()
    out = []
    for name, directory in named:
        if name in seen:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        seen.add(name)
        adapter = read_adapter(directory)
        recorded = adapter.base_fingerprint
        if recorded is not None:
            check_same_base(recorded, base_dir, f"adapter {name!r} ({adapter.directory})")
        out.append((name, adapter))
    return out


def load_adapters(model: nn.Module, named: Sequence[tuple[str, Adapter]]) -> ServedAdapters:
    """Puts the adapters (read_adapters) on `model` in slots 1..n; one ValueError, before anything changes,
    when one does not fit the model or the model carries an adapter already."""
    if not named:
        raise ValueError("no adapters to load")
    if lora_modules(model) or getattr(model, "lora_config", None) is not None or hasattr(model, "adapter_rows"):
        raise ValueError("this model already carries LoRA adapters")
    plans = []
    for name, adapter in named:
        try:
            plans.append(plan_adapter(model, adapter))
        except ValueError as err:
            raise ValueError(f"adapter {name!r}: {err}") from None
    blocks = moe_blocks(model)
    for (name, adapter), plan in zip(named, plans, strict=True):
        lacking = [b for b in plan.experts if not hasattr(blocks[b], SERVE_HOOK)]
        if lacking:
            raise ValueError(f"adapter {name!r} ({adapter.directory}): its routed-expert LoRA needs the MoE block's "
                             f"{SERVE_HOOK}, which {lacking[0]} lacks")
    experts = [{b: expert_lora_for(blocks[b], tensors, adapter.config, device=blocks[b].gate.weight.device,
                                   where=f"adapter {name!r} ({adapter.directory})")
                for b, tensors in plan.experts.items()}
               for (name, adapter), plan in zip(named, plans, strict=True)]  # may refuse
    fuse_projections(model)
    rows = AdapterRows(len(named))
    wrappers: dict[str, MultiLoRALinear] = {}
    for name in [n for n, _ in model.named_modules() if any(n in p.linears for p in plans)]:  # model order
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrappers[name] = MultiLoRALinear(getattr(parent, attr), rows)
        setattr(parent, attr, wrappers[name])
    for slot, ((_, adapter), plan) in enumerate(zip(named, plans, strict=True), start=1):
        cfg = adapter.config
        for name, pair in plan.linears.items():  # rank and alpha as load_adapter takes them
            r, alpha = pair["lora_A"].shape[0], cfg.rank_alpha(name)[1]
            wrappers[name].add(slot, pair["lora_A"], pair["lora_B"], lora_scaling(r, alpha, cfg.use_rslora))
        for block_name, lora in experts[slot - 1].items():
            getattr(blocks[block_name], SERVE_HOOK)(rows).add(slot, lora)
    model.adapter_rows = rows
    return ServedAdapters(tuple(n for n, _ in named), tuple(a.directory for _, a in named), rows)
