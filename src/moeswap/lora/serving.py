"""Several LoRA adapters on one model at once, each request with its own (`serve --lora NAME=PATH`,
`generate --lora`): adapter i is slot i + 1, slot 0 the base model. Every adapter is read and checked (base
fingerprint, then its tensors against the modules) before any is applied; dense targets are wrapped in
lora.multi.MultiLoRALinear, routed-expert LoRA goes into the blocks' ExpertLoRASlots, projections are fused
first (the C decode step reads the fused weights through the wrappers). No dropout.
Adapters can be added and removed while the model serves (ServedAdapters.add / remove; `serve
--allow-runtime-lora`): new slots, never reused. Entry points: `read_adapters`, `load_adapters` /
`serve_adapters` -> ServedAdapters.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from moeswap.lora.fingerprint import check_same_base
from moeswap.lora.layer import lora_scaling
from moeswap.lora.multi import AdapterRows, MultiLoRALinear
from moeswap.lora.peft_io import Adapter, expert_lora_for, plan_adapter, read_adapter
from moeswap.lora.targets import lora_modules, moe_blocks
from moeswap.models.layers.basic import fuse_projections

SERVE_HOOK = "serve_expert_lora"  # MoE blocks that take served routed-expert LoRA


class ServedAdapters:
    """The adapters a model serves, by slot (1, 2, ...; 0 is the base model), with the model's row -> slot
    context `rows` (also `model.adapter_rows`), which the scheduler sets around each forward. `add` and
    `remove` change them while the model serves (`serve --allow-runtime-lora`), between forwards: the caller
    runs them where no forward runs (the server's engine thread). A slot is never given to another adapter: a
    request that holds the slot of an adapter removed since finds it empty rather than someone else's.
    base_dir: the base model's directory, which the fingerprints adapters record are checked against."""

    def __init__(self, model: nn.Module, rows: AdapterRows, base_dir: str | os.PathLike | None = None):
        self.model, self.rows, self.base_dir = model, rows, base_dir
        self._slots: dict[int, tuple[str, Path]] = {}  # slot -> (name, directory), in slot order

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._slots.values())

    @property
    def directories(self) -> tuple[Path, ...]:
        return tuple(d for _, d in self._slots.values())

    def slot(self, name: str) -> int | None:
        """The slot serving `name`, or None."""
        return next((s for s, (n, _) in self._slots.items() if n == name), None)

    def add(self, named: Sequence[tuple[str, Adapter]]) -> list[int]:
        """Applies the adapters (read_adapters) in new slots, returned; one ValueError, before anything changes,
        when one does not fit the model or its name is served already."""
        model = self.model
        for name, _ in named:
            if self.slot(name) is not None:
                raise ValueError(f"an adapter named {name!r} is loaded already")
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
                raise ValueError(f"adapter {name!r} ({adapter.directory}): its routed-expert LoRA needs the MoE "
                                 f"block's {SERVE_HOOK}, which {lacking[0]} lacks")
        experts = [{b: expert_lora_for(blocks[b], tensors, adapter.config, device=blocks[b].gate.weight.device,
                                       where=f"adapter {name!r} ({adapter.directory})")
                    for b, tensors in plan.experts.items()}
                   for (name, adapter), plan in zip(named, plans, strict=True)]  # may refuse
        wrappers = {n: m for n, m in model.named_modules() if isinstance(m, MultiLoRALinear)}
        for name in [n for n, _ in model.named_modules() if any(n in p.linears for p in plans)]:  # model order
            if name not in wrappers:
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                wrappers[name] = MultiLoRALinear(getattr(parent, attr), self.rows)
                setattr(parent, attr, wrappers[name])
        slots = []
        for ((name, adapter), plan, expert_loras) in zip(named, plans, experts, strict=True):
            slot = self.rows.count + 1
            cfg = adapter.config
            for module, pair in plan.linears.items():  # rank and alpha as load_adapter takes them
                r, alpha = pair["lora_A"].shape[0], cfg.rank_alpha(module)[1]
                wrappers[module].add(slot, pair["lora_A"], pair["lora_B"], lora_scaling(r, alpha, cfg.use_rslora))
            for block_name, lora in expert_loras.items():
                getattr(blocks[block_name], SERVE_HOOK)(self.rows).add(slot, lora)
            self.rows.count = slot
            self._slots[slot] = (name, adapter.directory)
            slots.append(slot)
        return slots

    def remove(self, name: str) -> int:
        """Takes adapter `name` off the model (its tensors freed; wrappers stay, costing one check while no row
        uses them); returns its slot. KeyError: not served. No forward may use the slot meanwhile."""
        slot = self.slot(name)
        if slot is None:
            raise KeyError(name)
        for module in self.model.modules():
            if isinstance(module, MultiLoRALinear):
                module.remove(slot)
        for block in moe_blocks(self.model).values():
            served = block._modules.get("served_lora")
            if served is not None:
                served.remove(slot)
        del self._slots[slot]
        return slot


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


def serve_adapters(model: nn.Module, base_dir: str | os.PathLike | None = None) -> ServedAdapters:
    """Makes `model` ready to serve adapters, with none yet (ServedAdapters.add puts them on): its projections
    fused, its row -> slot context `model.adapter_rows`. ValueError when the model carries LoRA already."""
    if lora_modules(model) or getattr(model, "lora_config", None) is not None or hasattr(model, "adapter_rows"):
        raise ValueError("this model already carries LoRA adapters")
    fuse_projections(model)
    rows = AdapterRows(0)
    model.adapter_rows = rows
    return ServedAdapters(model, rows, base_dir)


def load_adapters(model: nn.Module, named: Sequence[tuple[str, Adapter]],
                  base_dir: str | os.PathLike | None = None) -> ServedAdapters:
    """Puts the adapters (read_adapters) on `model` in slots 1..n; one ValueError, before anything changes,
    when one does not fit the model or the model carries an adapter already."""
    if not named:
        raise ValueError("no adapters to load")
    served = serve_adapters(model, base_dir)
    try:
        served.add(named)
    except ValueError:
        del model.adapter_rows  # nothing was applied (add checks first); the projections' fusion changes no value
        raise
    return served
