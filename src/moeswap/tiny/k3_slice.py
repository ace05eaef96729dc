"""`init-tiny --size k3-slice`: Kimi K3 at its published widths (hidden 7168, vocabulary 163,840, 96 KDA heads
of 128, MLA ranks 1536 / 512, latent MoE 7168 -> 3584, MXFP4 experts of 3 x 3584 x 3072, 17.55 MB each), cut
to a few layers and fewer experts a layer: GBs, so written a tensor at a time (formats/writer.py) instead of
model.py's all-in-memory shards. Owns: the plan (every tensor's checkpoint name, dtype and shape, derived
from the model built on `meta` for the config, so it is what the loader checks), the shard cut, and the
tokenizer's specials at K3's ids. Values come from values.py.
Entry points: `plan(config)`, `write_tensors(out, config, seed, ...)`, `k3_specials(vocab_size)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from moeswap import archs
from moeswap.atomic_dir import writing
from moeswap.config import parse_config, routed_expert_shapes
from moeswap.formats.writer import layout, write_index, write_shard
from moeswap.models import build_model
from moeswap.tiny.tokenizer import DEFAULT_SPECIALS
from moeswap.tiny.values import generator, init_dense_as, random_mxfp4, stored_dtype

SHARD_BYTES = 4_000_000_000  # K3's own shards are ~16 GB; smaller ones here keep a slice's shards several
# K3's tokenizer: 256 specials on the top ids, [BOS] first and the end of a turn (its eos_token_id) third
# (bos 163584, eos 163586, pad 163839 in the published config.json)
SPECIAL_BLOCK = 256
_BOS, _EOS = 0, 2


@dataclass(frozen=True)
class Planned:
    """One tensor of the checkpoint: its name, dtype and shape as stored; `param` and `param_shape`: the model
    parameter it fills (a dense tensor), or `expert`: (layer, expert id, projection) of a routed expert's."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    param: str = ""
    param_shape: tuple[int, ...] = ()
    expert: tuple[int, int, str] | None = None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def plan(config: dict) -> list[list[Planned]]:
    """The checkpoint's tensors in units that are never split across shards: one dense tensor, or the six
    tensors of one routed expert (MXFP4 codes and scale bytes of w1, w2, w3), in layer order."""
    cfg = parse_config(config)
    if cfg.quant is None:
        raise ValueError("k3-slice writes K3's MXFP4 routed experts: its config must have a quantization_config")
    desc = archs.get(cfg.arch)
    prefix = cfg.weight_prefix
    units: list[list[Planned]] = []
    for name, param in build_model(cfg, device="meta").named_parameters():
        stored = desc.publish(name, torch.empty(param.shape, device="meta"), cfg)
        units.append([Planned(prefix + desc.published_name(name), stored_dtype(name), tuple(stored.shape), name,
                              tuple(param.shape))])
    shapes = routed_expert_shapes(cfg)
    for layer in (i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"):
        for e in range(cfg.moe.num_experts):
            unit = []
            for proj, (out_dim, in_dim) in shapes.items():
                base = prefix + desc.expert_name(layer, e, proj)
                unit += [Planned(base + ".weight_packed", torch.uint8, (out_dim, in_dim // 2), expert=(layer, e, proj)),
                         Planned(base + ".weight_scale", torch.uint8, (out_dim, in_dim // 32), expert=(layer, e, proj))]
            units.append(unit)
    return units


def shards(units: list[list[Planned]], shard_bytes: int) -> list[list[Planned]]:
    """Consecutive units cut into shards of about `shard_bytes` (at least two: the published layout is sharded)."""
    groups: list[list[list[Planned]]] = [[]]
    size = 0
    for unit in units:
        if size >= shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(unit)
        size += sum(t.nbytes for t in unit)
    if len(groups) == 1:
        half = len(units) // 2
        groups = [units[:half], units[half:]]
    return [[t for unit in group for t in unit] for group in groups]


def write_tensors(out: Path, config: dict, seed: int, shard_bytes: int | None = None, progress: bool = False) -> int:
    """Writes the checkpoint's shards and index into `out` (a staging directory: write_tiny_model renames it),
    one tensor in memory at a time. Returns the bytes of tensors written."""
    cfg = parse_config(config)
    desc = archs.get(cfg.arch)
    units = plan(config)
    total = sum(t.nbytes for unit in units for t in unit)
    groups = shards(units, shard_bytes or SHARD_BYTES)
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing k3-slice", disable=not progress) as bar:
        for i, group in enumerate(groups):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            specs = [(t.name, t.dtype, t.shape) for t in group]
            by_name = {t.name: t for t in group}
            with writing(out / file):
                write_shard(out / file, specs, _produce(layout(specs), by_name, desc, cfg, seed, bar))
            weight_map.update((t.name, file) for t in group)
    write_index(out, weight_map, total)
    return total


def _produce(ordered, by_name: dict[str, Planned], desc, cfg, seed: int, bar):
    """Each tensor's values in the writer's order; an expert projection's codes and scales are drawn together
    (one generator per projection), so the scales wait for their codes (stored right after them)."""
    pending: dict[str, torch.Tensor] = {}
    shapes = routed_expert_shapes(cfg)
    for name, _, _ in ordered:
        t = by_name[name]
        if t.expert is not None:
            if name not in pending:
                base = name.rsplit(".", 1)[0]
                packed, scale = random_mxfp4(shapes[t.expert[2]], generator(seed, base), wide=True)
                pending.update({base + ".weight_packed": packed, base + ".weight_scale": scale})
            value = pending.pop(name)
        else:
            value = desc.publish(t.param, init_dense_as(t.param, t.param_shape, generator(seed, t.param), t.dtype), cfg)
        yield name, value
        bar.update(t.nbytes)


def k3_specials(vocab_size: int) -> dict[str, int]:
    """The tokenizer's specials on K3's ids: a block of 256 on the top ids, bos and eos where K3 has them, the
    tiny tokenizer's other specials after them and reserved names for the rest."""
    first = vocab_size - SPECIAL_BLOCK
    named = [s for s in DEFAULT_SPECIALS if s not in ("<|bos|>", "<|end_of_msg|>")]
    ids = {"<|bos|>": first + _BOS, "<|end_of_msg|>": first + _EOS}
    free = (i for i in range(first, vocab_size) if i not in ids.values())
    ids.update(zip(named, free))
    ids.update((f"<|reserved_token_{i}|>", i) for i in free)
    return ids
