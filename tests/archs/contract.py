"""The contract every registered architecture keeps, as checks on each of its init-tiny checkpoints
(`check(Tiny)`): the config init-tiny writes parses back to the config it describes, in either key spelling;
the checkpoint map places every tensor and fills every parameter once, both ways; init-tiny is
deterministic; the loaded model's forward is deterministic and its decode step equals the forward.
Run over moeswap.archs.REGISTRY by test_arch_contract.py and on a toy by test_toy_arch.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from pathlib import Path

import torch

from moeswap import archs
from moeswap.config import load_config, parse_config, routed_expert_shapes
from moeswap.formats.checkpoint import Checkpoint
from moeswap.models import build_model
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import tiny_config, write_tiny_model


# Kimi's keys and the DeepSeek / transformers spelling of the same field (written out here, the oracle)
@dataclasses.dataclass(frozen=True)
class Tiny:
    """One init-tiny checkpoint: its architecture, --quant variant ("" for the plain layout) and directory."""

    arch: str
    quant: str
    path: Path


def variants(name: str) -> list[tuple[str, str]]:
    """(architecture, quant) of every init-tiny layout the architecture publishes."""
    return [(name, quant) for quant in ("", *archs.get(name).tiny_quants)]


SPELLINGS = {
    "num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts", "moe_router_activation_func": "scoring_func",
    "moe_renormalize": "norm_topk_prob", "num_expert_group": "n_group",
}


def _text(raw: dict) -> dict:
    return raw.get("text_config", raw)


def check_config_round_trip(tiny: Tiny) -> None:
    """config.json as written parses to the architecture and to the ModelConfig its layout describes (the
    writer adds only the tokenizer's special ids)."""
    written = load_config(tiny.path)
    assert written.arch == tiny.arch
    want = parse_config(tiny_config(tiny.arch, "tiny", tiny.quant))
    assert written.eos_token_ids and written.bos_token_id is not None
    assert dataclasses.replace(want, eos_token_ids=written.eos_token_ids, bos_token_id=written.bos_token_id,
                               pad_token_id=written.pad_token_id) == written


def check_other_key_spelling(tiny: Tiny) -> None:
    """The same config.json with every field in its other spelling parses to the same ModelConfig."""
    raw = json.loads((tiny.path / "config.json").read_text())
    other = {**SPELLINGS, **{v: k for k, v in SPELLINGS.items()}}
    text = _text(raw)
    assert any(k in other for k in text), "the layout uses none of the two-spelling fields"
    swapped = {other.get(k, k): v for k, v in text.items()}
    raw2 = {**raw, "text_config": swapped} if "text_config" in raw else swapped
    assert parse_config(raw2) == load_config(tiny.path)


def check_checkpoint_map_covers_the_checkpoint(tiny: Tiny) -> None:
    """Every tensor is a routed expert of an MoE layer (under expert_name), skipped, one parameter of the
    model, or the block-FP8 scale beside one; every parameter is filled exactly once and published_name
    names its tensor; every routed expert's three projections are there."""
    arch, config = archs.get(tiny.arch), load_config(tiny.path)
    params = dict(build_model(config, device="meta").named_parameters())
    moe_layers = [i for i, k in enumerate(config.mlp_kinds) if k == "moe"]
    filled: dict[str, str] = {}
    experts: set[tuple[int, int, str]] = set()
    scales: list[str] = []
    with Checkpoint.open(tiny.path) as ckpt:
        for tensor in ckpt.names():
            assert tensor.startswith(config.weight_prefix), tensor
            local = tensor.removeprefix(config.weight_prefix)
            target, match = arch.classify(local)
            if target != "expert" and local.endswith(".weight_scale_inv"):
                scales.append(local.removesuffix("_scale_inv"))
            elif target == "expert":
                layer, expert, proj, kind = arch.expert_key(match)
                assert layer in moe_layers and 0 <= expert < config.moe.num_experts, tensor
                assert proj in routed_expert_shapes(config), tensor
                assert local == f"{arch.expert_name(layer, expert, proj)}.{kind}", tensor
                experts.add((layer, expert, proj))
            elif target != "skip":
                assert target in params, f"{tensor} -> {target}: no such parameter"
                assert target not in filled, f"{target} filled by {filled[target]} and {tensor}"
                filled[target] = local
    assert sorted(filled) == sorted(params)
    assert set(scales) <= set(filled.values()), "a weight_scale_inv beside no dense weight"
    assert all(arch.published_name(p) == local for p, local in filled.items())
    want = {(layer, e, p) for layer in moe_layers for e in range(config.moe.num_experts)
            for p in routed_expert_shapes(config)}
    assert experts == want


def check_init_tiny_is_deterministic(tiny: Tiny) -> None:
    """init-tiny with the same seed writes the same bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        again = write_tiny_model(Path(tmp) / "again", tiny.arch, "tiny", seed=0, quant=tiny.quant)
        files = sorted(f.name for f in tiny.path.iterdir())
        assert files == sorted(f.name for f in again.iterdir())
        for f in files:
            assert (tiny.path / f).read_bytes() == (again / f).read_bytes(), f"{f} differs between two writes"


def _tokens(model, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(7))


def check_forward_is_deterministic(tiny: Tiny) -> None:
    """Two forwards of one model, and the forward of a second load, give the same logits bit for bit."""
    model, _ = load_model(tiny.path, LoadOptions(dtype="float32"))
    again, _ = load_model(tiny.path, LoadOptions(dtype="float32"))
    tokens = _tokens(model)
    with torch.inference_mode():
        first = model(tokens)
        assert first.shape == (*tokens.shape, model.config.vocab_size) and torch.isfinite(first).all()
        assert first.std() > 0.1  # not a near-constant output
        assert torch.equal(model(tokens), first)
        assert torch.equal(again(tokens), first)


def check_decode_step_equals_the_forward(tiny: Tiny) -> None:
    """Prefill all but the last token into a state, then one decode step: its logits are the full
    forward's at the last position (within the layers' own incremental tolerance)."""
    model, _ = load_model(tiny.path, LoadOptions(dtype="float32"))
    tokens = _tokens(model)
    state = model.make_state(tokens.shape[0])
    with torch.inference_mode():
        full = model(tokens)
        model(tokens[:, :-1], state)
        step = model(tokens[:, -1:], state)
    want = full[:, -1:]
    err, scale = (step - want).abs().max().item(), want.abs().max().item()
    assert step.shape == want.shape and err <= 1e-5 * scale, f"max abs err {err:.3e} vs scale {scale:.3e}"


CHECKS = (check_config_round_trip, check_other_key_spelling, check_checkpoint_map_covers_the_checkpoint,
          check_init_tiny_is_deterministic, check_forward_is_deterministic, check_decode_step_equals_the_forward)


def check_id(check) -> str:
    return re.sub(r"^check_", "", check.__name__)
