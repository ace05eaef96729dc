"""Where each routed expert's tensors sit in a checkpoint, and how to turn them into weights.

`ExpertIndex` is built by the loader from CHECKPOINT_MAP matches and validated against the config
(every expert of every MoE layer present, with the right shapes and dtypes). `load_expert` reads one
expert's tensors (MXFP4 packed+scale, MXFP8 float8+scale, or float) and decodes them; nothing else is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeswap.config import ModelConfig
from moeswap.formats import mxfp4, mxfp8
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.models import routed_expert_shapes
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights

PROJS = ("w1", "w2", "w3")  # gate, down, up


@dataclass
class ExpertIndex:
    """(layer, expert) -> {proj: {kind: checkpoint tensor name}}, kind in weight / weight_packed / weight_scale."""

    entries: dict[tuple[int, int], dict[str, dict[str, str]]] = field(default_factory=dict)

    def add(self, layer: int, expert: int, proj: str, kind: str, name: str) -> None:
        self.entries.setdefault((layer, expert), {}).setdefault(proj, {})[kind] = name

    def validate(self, ckpt: Checkpoint, cfg: ModelConfig) -> None:
        """Every MoE layer has all experts with consistent shapes; fails naming the first bad tensor."""
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
        out_dim, in_dim = shape
        if "weight" in kinds and "weight_scale" in kinds:  # MXFP8: float8 weight + E8M0 scale bytes
            self._check_format(cfg, kinds["weight"], "mxfp8-quantized", "MXFP8")
            info = ckpt.info(kinds["weight"])
            _expect(info, shape, None, base)
            if info.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise CheckpointError(f"{info.name} in {info.file.name} ({base}): MXFP8 weight must be float8_e4m3fn "
                                      f"or float8_e5m2, found {info.dtype}")
            _expect(ckpt.info(kinds["weight_scale"]), (out_dim, in_dim // 32), torch.uint8, base)
            return
        if "weight" in kinds:
            info = ckpt.info(kinds["weight"])
            _expect(info, shape, None, base)
            if not info.dtype.is_floating_point:
                raise CheckpointError(f"{info.name} in {info.file.name}: expected a float tensor, found {info.dtype}")
            if info.dtype.itemsize == 1:
                raise CheckpointError(f"{info.name} in {info.file.name} ({base}): float8 weight without a "
                                      f"weight_scale: expected bf16/fp16/fp32, or MXFP8 weight + weight_scale")
            return
        if "weight_packed" not in kinds or "weight_scale" not in kinds:
            raise CheckpointError(f"missing tensor for {base}: need weight, or weight_packed + weight_scale (MXFP4), "
                                  f"or weight + weight_scale (MXFP8)")
        self._check_format(cfg, kinds["weight_packed"], "mxfp4-pack-quantized", "MXFP4")
        _expect(ckpt.info(kinds["weight_packed"]), (out_dim, in_dim // 2), torch.uint8, base)
        _expect(ckpt.info(kinds["weight_scale"]), (out_dim, in_dim // 32), torch.uint8, base)

    @staticmethod
    def _check_format(cfg, name: str, fmt: str, short: str) -> None:
        if cfg.quant is None:
            raise CheckpointError(f"{name}: packed {short} expert but config.json has no quantization_config")
        if cfg.quant.format != fmt:
            raise CheckpointError(f"{name}: stored as {short} ({fmt}) but config.json's quantization_config "
                                  f"says format {cfg.quant.format}")

    def names(self, layer: int, expert: int) -> dict[str, dict[str, str]]:
        return self.entries[(layer, expert)]

    def stored_bytes(self, ckpt: Checkpoint, layer: int, expert: int) -> int:
        return sum(ckpt.info(n).nbytes for kinds in self.entries[(layer, expert)].values() for n in kinds.values())


def _expect(info, shape, dtype, what: str) -> None:
    if tuple(info.shape) != tuple(shape):
        raise CheckpointError(f"{info.name} in {info.file.name} ({what}): expected shape {list(shape)} "
                              f"from config.json, found {list(info.shape)}")
    if dtype is not None and info.dtype != dtype:
        raise CheckpointError(f"{info.name} in {info.file.name} ({what}): expected dtype {dtype}, found {info.dtype}")


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
        if not decode and all("weight_packed" in kinds for kinds in names.values()):
            parts = {f"{proj}_{kind.removeprefix('weight_')}": read(n).to(device)
                     for proj, kinds in names.items() for kind, n in kinds.items()}
            return MXFP4ExpertWeights(**parts)
        mats = {}
        for proj, kinds in names.items():
            if "weight" in kinds and "weight_scale" in kinds:
                w = mxfp8.decode(read(kinds["weight"]), read(kinds["weight_scale"]), torch.float32).to(dtype)
            elif "weight" in kinds:
                w = read(kinds["weight"]).to(dtype)
            else:
                w = mxfp4.decode(read(kinds["weight_packed"]), read(kinds["weight_scale"]), torch.float32).to(dtype)
            mats[proj] = w.to(device)
    except (OSError, ValueError) as err:
        files = sorted({str(ckpt.info(n).file) for kinds in names.values() for n in kinds.values()})
        raise CheckpointError(f"layer {layer} expert {expert}: cannot read or decode its tensors from "
                              f"{', '.join(files)}: {err}") from err
    return ExpertWeights(w1_FI=mats["w1"], w3_FI=mats["w3"], w2_IF=mats["w2"])
