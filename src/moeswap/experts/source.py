"""Where each routed expert's tensors sit in a checkpoint, and how to turn them into weights.

`ExpertIndex` is built by the loader from the architecture's checkpoint_map matches and validated against the config
(every expert of every MoE layer present, with the right shapes and dtypes, all in one format: its
`format`, a weights format object chosen here once). `load_expert` reads one expert's tensors through
that format (MXFP4 kept as bytes if asked, else decoded); nothing else is read. `check_expert` refuses
bytes that cannot decode to finite weights, naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeswap.config import ModelConfig, routed_expert_shapes
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights
from moeswap.weights import registry
from moeswap.weights.format import PROJS, WeightFormat


@dataclass
class ExpertIndex:
    """(layer, expert) -> {proj: {kind: checkpoint tensor name}}, kind in weight / weight_packed / weight_scale."""

    entries: dict[tuple[int, int], dict[str, dict[str, str]]] = field(default_factory=dict)
    _format: WeightFormat | None = field(default=None, repr=False)

    def add(self, layer: int, expert: int, proj: str, kind: str, name: str) -> None:
        self.entries.setdefault((layer, expert), {}).setdefault(proj, {})[kind] = name

    @property
    def format(self) -> WeightFormat:
        """The format every routed expert is stored in (validate checks they agree; before that, the
        first expert's)."""
        if self._format is None:
            first = self.entries[min(self.entries)]
            fmt = registry.for_suffixes(next(iter(first.values())))
            if fmt is None:
                raise CheckpointError(f"routed expert {min(self.entries)}: tensors {sorted(first)} fit no expert format")
            self._format = fmt
        return self._format

    def validate(self, ckpt: Checkpoint, cfg: ModelConfig) -> None:
        """Every MoE layer has all experts with consistent shapes, all in one format; fails naming the first
        bad tensor."""
        moe_layers = [i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"]
        stray = sorted({layer for layer, _ in self.entries} - set(moe_layers))
        if stray:
            raise CheckpointError(f"checkpoint has routed-expert tensors for layer {stray[0]}, "
                                  f"which config.json says is not an MoE layer")
        extra = sorted(key for key in self.entries if key[1] >= cfg.moe.num_experts)
        if extra:
            layer, e = extra[0]
            raise CheckpointError(f"checkpoint has routed-expert tensors for layer {layer} expert {e} (and "
                                  f"{len(extra) - 1} more), but config.json says num_experts={cfg.moe.num_experts}")
        logical = routed_expert_shapes(cfg)
        for layer in moe_layers:
            for e in range(cfg.moe.num_experts):
                projs = self.entries.get((layer, e))
                if projs is None:
                    raise CheckpointError(
                        f"missing routed expert: layer {layer} expert {e} has no tensors "
                        f"(config.json says num_experts={cfg.moe.num_experts})")
                for proj in PROJS:
                    self._check_proj(ckpt, cfg, layer, e, proj, projs.get(proj, {}), logical[proj])

    def _check_proj(self, ckpt, cfg, layer, e, proj, kinds, shape) -> None:
        base = f"layer {layer} expert {e} {proj}"
        fmt = registry.for_suffixes(kinds)
        if fmt is None:
            raise CheckpointError(f"missing tensor for {base}: need weight, or weight_packed + weight_scale (MXFP4), "
                                  f"or weight + weight_scale (MXFP8), or weight + weight_scale_inv (block FP8)")
        first = kinds[fmt.main]
        fmt.check_declared(first, cfg.quant.format if cfg.quant is not None else None,
                           cfg.quant.fp8_block if cfg.quant is not None else None)
        fmt.check_expert_tensors(ckpt, kinds, shape, base)
        if self._format is None:
            self._format = fmt
        elif fmt is not self._format:
            raise CheckpointError(f"{first} in {ckpt.info(first).file.name} ({base}) is stored as {fmt.label}, but "
                                  f"the routed experts before it as {self._format.label}: moeswap keeps all routed "
                                  f"experts of a model in one format (re-store them with `moeswap quantize`)")

    def names(self, layer: int, expert: int) -> dict[str, dict[str, str]]:
        return self.entries[(layer, expert)]

    def stored_bytes(self, ckpt: Checkpoint, layer: int, expert: int) -> int:
        return sum(ckpt.info(n).nbytes for kinds in self.entries[(layer, expert)].values() for n in kinds.values())


def check_expert(ckpt: Checkpoint, index: ExpertIndex, layer: int, expert: int,
                 w: ExpertWeights | MXFP4ExpertWeights) -> None:
    """Fails naming the tensor when an expert's bytes cannot decode to finite weights (what that means is
    the format's: WeightFormat.check_finite)."""
    problem = index.format.check_finite(w, index.names(layer, expert))
    if problem is not None:
        name, proj, what = problem
        raise CheckpointError(_corrupt(ckpt, name, layer, expert, proj, what))


def _corrupt(ckpt: Checkpoint, name: str, layer: int, expert: int, proj: str, what: str) -> str:
    return (f"{name} in {ckpt.info(name).file} (layer {layer} expert {expert} {proj}): {what}; the file is "
            f"corrupt: re-download or re-copy it")


def load_expert(ckpt: Checkpoint, index: ExpertIndex, layer: int, expert: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", use_mmap: bool = False,
                decode: bool = True) -> ExpertWeights | MXFP4ExpertWeights:
    """Read one expert. By default it reads exactly the expert's byte ranges (pread), so touched
    pages are not mapped into the process; use_mmap=True serves them from the memory map.
    decode=False keeps MXFP4 experts as their bytes (MXFP4ExpertWeights); float and MXFP8 experts are
    always decoded."""
    read = ckpt.get if use_mmap else ckpt.read
    names = index.names(layer, expert)
    try:
        return index.format.read_expert(read, names, dtype, device, keep_bytes=not decode)
    except (OSError, ValueError) as err:
        files = sorted({str(ckpt.info(n).file) for kinds in names.values() for n in kinds.values()})
        raise CheckpointError(f"layer {layer} expert {expert}: cannot read or decode its tensors from "
                              f"{', '.join(files)}: {err}") from err
