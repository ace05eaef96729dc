"""A fully trained model written back as a model directory in its base's published layout.

Full mode changes every weight, so its result is a checkpoint like the one it started from: the same
tensor names, shapes (A_log keeps K3's zero-padded [128] or transformers' [1,1,H,1]) and dtypes, shards
and index, config.json, tokenizer and generation files copied. Routed experts are written as bf16
`experts.{e}.w{1,2,3}.weight` (the config's quantization_config is dropped): quantising them is
`moeswap quantize`'s job, which also reports the error it costs. Tensors the model does not own (a
vision tower) are copied byte for byte. Entry point: `write_model(model, base_dir, out_dir)`.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from torch import nn

from moeswap import archs, jsonio
from moeswap.config import parse_config
from moeswap.formats.checkpoint import Checkpoint
from moeswap.formats.files import read_json
from moeswap.formats.writer import layout, write_index, write_shard
from moeswap.quantize import copy_side_files, side_files
from moeswap.train.experts import expert_tensors, moe_blocks

EXPERT_DTYPE = torch.bfloat16
SHARD_BYTES = 2 << 30


def _to_stored(value: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    """A model parameter in the base tensor's layout: reshaped (same size) or zero-padded (K3's A_log)."""
    flat = value.detach().reshape(-1).to(dtype)
    numel = math.prod(shape)
    if flat.numel() == numel:
        return flat.reshape(shape)
    if len(shape) == 1 and flat.numel() < numel:
        return torch.cat([flat, flat.new_zeros(numel - flat.numel())])
    raise ValueError(f"{name}: the trained tensor has {flat.numel()} values, the base stores {list(shape)}")


def write_model(model: nn.Module, base_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Writes `model` into out_dir (which exists) in base_dir's layout; returns the files written."""
    base, out = Path(base_dir), Path(out_dir)
    raw = read_json(base / "config.json", ValueError)
    config = parse_config(raw)
    arch = archs.get(config.arch)
    ckpt = Checkpoint.open(base)
    params = dict(model.named_parameters())
    experts = {b.layer_idx: expert_tensors(b) for b in moe_blocks(model) if "experts" in b._modules}
    prefix = config.weight_prefix
    plan: list[tuple[str, torch.dtype, tuple[int, ...], object]] = []  # (name, dtype, shape, source)
    for name in ckpt.names():
        local = name[len(prefix):] if prefix and name.startswith(prefix) else name
        target, match = arch.classify(local)
        info = ckpt.info(name)
        if target == "skip":
            plan.append((name, info.dtype, info.shape, ("copy", name)))
        elif target == "expert":
            layer, e, proj, kind = match.groups()
            if kind == "weight_scale":
                continue
            if int(layer) not in experts:
                raise ValueError(f"{name}: the model's routed experts were not trained (full mode with every "
                                 "parameter makes them trainable); there is nothing to write for them")
            w = experts[int(layer)][int(e), proj]
            stem = name.rsplit(".", 1)[0]
            plan.append((stem + ".weight", EXPERT_DTYPE, tuple(w.shape), ("tensor", w)))
        else:
            value = _to_stored(params[target], info.shape, info.dtype, name)
            plan.append((name, info.dtype, info.shape, ("tensor", value)))
    shards: list[list] = [[]]
    size = 0
    for entry in plan:
        nbytes = entry[1].itemsize * math.prod(entry[2])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    weight_map, total, files = {}, 0, []
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        by_name = {n: src for n, _, _, src in shard}

        def produce(specs, by_name=by_name):
            for n, dtype, _ in layout(specs):
                kind, src = by_name[n]
                yield n, (ckpt.read(src) if kind == "copy" else src).to(dtype).contiguous()

        specs = [(n, dtype, tuple(shape)) for n, dtype, shape, _ in shard]
        total += write_shard(out / file, specs, produce(specs))
        weight_map.update({n: file for n, *_ in shard})
        files.append(file)
    write_index(out, weight_map, total)
    cfg = copy.deepcopy(raw)
    for d in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        d.pop("quantization_config", None)
    (out / "config.json").write_text(jsonio.dumps(cfg, indent=2) + "\n")
    side = side_files(base)
    copy_side_files(side, out)
    return sorted([*files, "model.safetensors.index.json", "config.json", *(p.name for p in side)])
