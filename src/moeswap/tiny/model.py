"""Tiny models in the exact published checkpoint layout: the architecture's description (moeswap.archs)
gives config.json, the names and each tensor's layout; this file draws the values (bf16; MXFP4 experts
where the config quantises them; by `quant`, block FP8 "fp8" or INT4 experts "int4"), deterministic by
(seed, tensor name), in >= 2 shards with an index and a tokenizer (tokenizer.py).
Entry point: `write_tiny_model(out_dir, arch, size, seed)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from moeswap import archs, jsonio
from moeswap.atomic_dir import atomic_directory, writing
from moeswap.config import parse_config, routed_expert_shapes
from moeswap.formats import compressed_tensors as ct
from moeswap.formats import fp8_block
from moeswap.models import build_model
from moeswap.text.tokenizer import load_tokenizer
from moeswap.tiny import k3_slice
from moeswap.tiny.sizes import SIZES, dims_for
from moeswap.tiny.tokenizer import build_tiny_tokenizer
from moeswap.tiny.values import generator, init_dense, random_mxfp4, stored_dtype

QUANTS = ("fp8", "int4")  # the --quant variants this file draws; an architecture lists those it publishes


def tiny_config(arch: str, size: str, quant: str = "", layers: int | None = None, experts: int | None = None) -> dict:
    """config.json content in the layout the real model ships, for every architecture in the registry
    (its description's `tiny_config`; tests/archs run each one through init-tiny). layers, experts: the
    size's layer count and routed experts a layer, changed."""
    if arch not in archs.REGISTRY:
        raise ValueError(f"--arch {arch!r}: expected one of {', '.join(archs.REGISTRY)}")
    description = archs.REGISTRY[arch]
    if quant and quant not in description.tiny_quants:
        raise ValueError(f"--quant {quant}: the quantised variants ({', '.join(QUANTS)}) are DeepSeek-V3 / Kimi K2 "
                         f"layouts, not {arch}'s")
    if size == "k3-slice" and (arch != "kimi_k3" or quant):
        raise ValueError(f"--size k3-slice is Kimi K3's own layout (--arch kimi_k3, no --quant), not {arch}"
                         + (f" with --quant {quant}" if quant else ""))
    config = description.tiny_config(dims_for(size, layers, experts), size, quant)
    if config is None:
        raise ValueError(f"init-tiny has no config layout for architecture {arch!r} yet (its Arch.tiny_config)")
    return config


def tensors_for(arch: str, size: str, seed: int, quant: str = "", layers: int | None = None,
                experts: int | None = None):
    """Yields (checkpoint name, tensor) in layer order, the routed experts of a layer together."""
    raw = tiny_config(arch, size, quant, layers, experts)
    cfg = parse_config(raw)
    prefix = cfg.weight_prefix
    model = build_model(cfg, device="meta")
    desc = archs.get(arch)  # the architecture's published names and tensor layouts
    for name, param in model.named_parameters():
        gen = generator(seed, name)
        value = desc.publish(name, init_dense(name, tuple(param.shape), gen, cfg.kda.num_heads), cfg)
        if quant == "fp8" and _fp8_quantised(name, value):
            yield from _fp8_block(prefix + desc.published_name(name).removesuffix(".weight"), value)
            continue
        yield prefix + desc.published_name(name), value.to(stored_dtype(name))
    shapes = routed_expert_shapes(cfg)
    for layer in (i for i, k in enumerate(cfg.mlp_kinds) if k == "moe"):
        for e in range(cfg.moe.num_experts):
            for proj, shape in shapes.items():
                name = prefix + desc.expert_name(layer, e, proj)
                gen = generator(seed, name)
                if quant == "fp8":
                    yield from _fp8_block(name, torch.randn(shape, generator=gen) / math.sqrt(shape[1]))
                elif quant == "int4":
                    w = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
                    yield from ((f"{name}.{suffix}", t) for suffix, t in ct.encode_weight("int4", w).items())
                elif cfg.quant is not None:
                    packed, scale = random_mxfp4(shape, gen)
                    yield name + ".weight_packed", packed
                    yield name + ".weight_scale", scale
                else:
                    yield name + ".weight", (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(torch.bfloat16)


def _fp8_quantised(param_name: str, value: torch.Tensor) -> bool:
    """Which of DeepSeek-V3's tensors it ships as block FP8: every Linear weight (the *_proj and
    kv_a_proj_with_mqa) but the router's and lm_head."""
    return value.ndim == 2 and param_name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def _fp8_block(module: str, value: torch.Tensor):
    """`module`'s (weight, weight_scale_inv) for `value` by the block-FP8 codec (formats/fp8_block.py)."""
    q, scale_inv = fp8_block.encode(value.float())
    yield module + ".weight", q
    yield module + ".weight_scale_inv", scale_inv


def write_tiny_model(out_dir: str | Path, arch: str = "kimi_k3", size: str = "tiny", seed: int = 0,
                     shard_bytes: int | None = None, progress: bool = False, quant: str = "",
                     tokenizer_lines: Iterable[str] | None = None, layers: int | None = None,
                     experts: int | None = None) -> Path:
    """Writes the model atomically: into a temporary sibling directory, renamed at the end. quant: DeepSeek-V3
    with block-FP8 weights ("fp8") or INT4 routed experts ("int4"), as published. tokenizer_lines: the text
    its BPE is trained on (default: the built-in corpus). layers, experts: change the size's layer count and
    routed experts a layer. Size k3-slice (Kimi K3's widths) is written a tensor at a time by k3_slice.py."""
    if size not in SIZES:
        raise ValueError(f"--size {size!r}: expected one of {', '.join(SIZES)}")
    tiny_config(arch, size, quant, layers, experts)  # checks the architecture before anything is written
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory; choose another directory")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose another directory or remove it")
    with atomic_directory(out) as tmp:
        _write(tmp, arch, size, seed, shard_bytes, progress, quant, tokenizer_lines, layers, experts)
    return out


def _write(out: Path, arch: str, size: str, seed: int, shard_bytes: int | None, progress: bool,
           quant: str = "", tokenizer_lines: Iterable[str] | None = None, layers: int | None = None,
           experts: int | None = None) -> None:
    config = tiny_config(arch, size, quant, layers, experts)
    text = config.get("text_config", config)
    specials = k3_slice.k3_specials(text["vocab_size"]) if size == "k3-slice" else None
    build_tiny_tokenizer(out, text["vocab_size"], specials=specials, lines=tokenizer_lines)
    eos, bos, pad, stops = _special_ids(out)
    for c in (config, text):
        c.update(eos_token_id=eos, bos_token_id=bos, pad_token_id=pad)
    (out / "config.json").write_text(jsonio.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(jsonio.dumps({"eos_token_id": stops, "bos_token_id": bos}, indent=2)
                                                + "\n")
    if size == "k3-slice":
        k3_slice.write_tensors(out, config, seed, shard_bytes, progress)
        return

    items = list(tqdm(tensors_for(arch, size, seed, quant, layers, experts), desc="making tensors", unit=" tensors",
                      disable=not progress))
    total = sum(t.numel() * t.element_size() for _, t in items)
    shard_bytes = shard_bytes or max(1, total // 3)
    # Shards are cut only between units: one dense tensor, or all tensors of one routed expert (the
    # published files never split an expert across shards).
    units: list[list[tuple[str, torch.Tensor]]] = []
    last_expert = None
    for name, tensor in items:
        m = _EXPERT_KEY.match(name)
        expert = m[1] if m else None
        if expert is not None and expert == last_expert:
            units[-1].append((name, tensor))
        else:
            units.append([(name, tensor)])
        last_expert = expert
    groups, current, current_bytes = [], [], 0
    for unit in units:
        current.append(unit)
        current_bytes += sum(t.numel() * t.element_size() for _, t in unit)
        if current_bytes >= shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)
    if len(groups) == 1:  # the published layout is sharded: always write at least two
        half = len(units) // 2
        groups = [units[:half], units[half:]]
    shards = [{name: t.contiguous() for unit in group for name, t in unit} for group in groups]
    weight_map, total_size = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        with writing(out / file):
            save_file(shard, str(out / file), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = file
            total_size += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(jsonio.dumps(index, indent=2) + "\n")


_EXPERT_KEY = re.compile(r"(.*\.experts\.\d+)\.")


def _special_ids(out: Path) -> tuple[int, int, int, int | list[int]]:
    """(eos, bos, pad, generation_config's eos_token_id): generation stops at the end of sequence and at the
    chat template's end of turn where that is another token, as chat checkpoints list both (Kimi K2's
    generation_config names <|im_end|>), so that a model fine-tuned on chat turns stops after its answer."""
    tok = load_tokenizer(out)
    eos = tok.eos_ids[0]
    bos = tok.bos_id if tok.bos_id is not None else eos
    turn_end = tok.turn_end_id
    return eos, bos, tok.vocab_size - 1, eos if turn_end in (None, eos) else [eos, turn_end]
