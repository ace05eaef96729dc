"""The one loader: config.json + safetensors -> model with dense weights, routed experts in a store.

Builds the model on `meta`, classifies every checkpoint tensor through the architecture's
CHECKPOINT_MAP, fills each parameter from exactly its byte range (pread into owned memory, so the
process holds the dense weights once and maps nothing), indexes routed experts for the store, and
fails on any unmapped, missing, misshapen or wrongly typed tensor. Entry point: `load_model(path, LoadOptions)`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moeswap.config import ModelConfig, load_config
from moeswap.experts.source import ExpertIndex
from moeswap.experts.store import CheckpointExpertStore
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.models import REGISTRY, build_model


@dataclass(frozen=True)
class LoadOptions:
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on accelerators
    device: str = "cpu"
    expert_memory: int = 1 << 30  # bytes of decoded experts kept between steps


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"--dtype {name!r} is not a floating-point torch dtype (try float32, bfloat16, float16)")
    return dtype


def load_model(path: str | Path, options: LoadOptions = LoadOptions()):
    """Returns (model, store). The model is in eval mode with requires_grad=False everywhere."""
    config = load_config(path)
    ckpt = Checkpoint.open(path)
    dtype = resolve_dtype(options.dtype, options.device)
    model = build_model(config, device="meta")
    index = fill_from_checkpoint(model, ckpt, config, dtype, options.device)
    index.validate(ckpt, config)
    store = CheckpointExpertStore(ckpt, index, dtype, options.device, options.expert_memory)
    for block in model.moe_blocks():
        block.store = store
    return model.eval(), store


def checkpoint_map_module(config: ModelConfig):
    return importlib.import_module(REGISTRY[config.arch].split(":")[0])


def fill_from_checkpoint(model: nn.Module, ckpt: Checkpoint, config: ModelConfig, dtype: torch.dtype,
                         device: str) -> ExpertIndex:
    arch = checkpoint_map_module(config)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    index = ExpertIndex()
    prefix = config.weight_prefix
    for name in ckpt.names():
        local = name[len(prefix):] if prefix and name.startswith(prefix) else name
        target, match = arch.classify(local)
        if target == "skip":
            continue
        if target == "expert":
            layer, expert, proj, kind = match.groups()
            index.add(int(layer), int(expert), proj, kind, name)
            continue
        if target not in params:
            info = ckpt.info(name)
            raise CheckpointError(
                f"unmapped tensor {name} in {info.file.name}: the {config.arch} model built from config.json "
                f"has no parameter {target!r} (does config.json match this checkpoint?)")
        param = params[target]
        info = ckpt.info(name)
        if not info.dtype.is_floating_point:
            raise CheckpointError(f"{name} in {info.file.name}: expected a float tensor, found {info.dtype}")
        tensor = arch.sanitize(target, ckpt.read(name), config)
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{name} in {info.file.name}: expected shape {list(param.shape)} from config.json, "
                f"found {list(info.shape)}")
        _set_param(model, target, tensor, dtype, device)
        filled.add(target)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(prefix + m for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensors in {ckpt.root}: {shown}{more}")
    return index


def _set_param(model: nn.Module, target: str, tensor: torch.Tensor, dtype: torch.dtype, device: str) -> None:
    owner_name, _, attr = target.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    # Keep fp32 where the reference computes in fp32 (router bias, gate constants); the rest in `dtype`.
    keep_fp32 = attr in ("A_log", "dt_bias", "e_score_correction_bias")
    value = tensor.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
