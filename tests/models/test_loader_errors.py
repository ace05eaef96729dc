"""load_model on damaged copies of a tiny K3: every failure names the file / tensor / field, and a good
model loads without touching routed-expert data."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeswap.config import ConfigError
from moeswap.formats.checkpoint import INDEX_NAME, Checkpoint, CheckpointError
from moeswap.models.loader import load_model

P = "language_model.model.layers"  # K3 text tensors carry the language_model. prefix


# -- helpers --------------------------------------------------------------------------------------


def shard_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def edit_tensors(model: Path, edit: Callable[[dict[str, torch.Tensor]], None], *, update_index: bool = True) -> None:
    """Apply `edit` to {name: tensor} over all shards, then rewrite the shards (each keeps the names it had;
    new names go to the last shard) and, unless told otherwise, the index's weight_map."""
    shards = {f.name: load_file(f) for f in shard_files(model)}
    where = {name: shard for shard, tensors in shards.items() for name in tensors}
    tensors = {name: t for shard in shards.values() for name, t in shard.items()}
    edit(tensors)
    last = sorted(shards)[-1]
    new: dict[str, dict[str, torch.Tensor]] = {shard: {} for shard in shards}
    for name, t in tensors.items():
        new[where.get(name, last)][name] = t.contiguous()
    for shard, content in new.items():
        save_file(content, str(model / shard), metadata={"format": "pt"})
    if update_index:
        index = json.loads((model / INDEX_NAME).read_text())
        index["weight_map"] = {name: shard for shard, content in new.items() for name in content}
        (model / INDEX_NAME).write_text(json.dumps(index, indent=2))


def edit_config(model: Path, edit: Callable[[dict], None]) -> None:
    raw = json.loads((model / "config.json").read_text())
    edit(raw.get("text_config", raw))
    (model / "config.json").write_text(json.dumps(raw, indent=2))


def shard_of(model: Path, name: str) -> str:
    return json.loads((model / INDEX_NAME).read_text())["weight_map"][name]


def load_error(model: Path, error: type[Exception] = CheckpointError) -> str:
    with pytest.raises(error) as info:
        load_model(model)
    return str(info.value)


@pytest.fixture
def k3(tiny_k3_dir, copy_model) -> Path:
    return copy_model(tiny_k3_dir)


# -- a good model ----------------------------------------------------------------------------------


def test_good_model_loads_without_reading_experts(tiny_k3_dir, monkeypatch):
    touched: list[str] = []
    for method in ("get", "read"):
        original = getattr(Checkpoint, method)

        def spy(self, name, _original=original):
            touched.append(name)
            return _original(self, name)

        monkeypatch.setattr(Checkpoint, method, spy)

    model, store = load_model(tiny_k3_dir)
    assert store.stats.misses == 0 and store.stats.bytes_read == 0 and len(store.fast) == 0
    assert touched, "the spy saw no reads at all"
    assert not [n for n in touched if ".experts." in n]  # dense tensors only
    assert model.config.arch == "kimi_k3"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    # every MoE layer has every expert indexed, nothing else
    moe_layers = [i for i, k in enumerate(model.config.mlp_kinds) if k == "moe"]
    assert set(store.index.entries) == {(layer, e) for layer in moe_layers for e in range(model.config.moe.num_experts)}
    # parameters hold the checkpoint's values
    embed = Checkpoint.open(tiny_k3_dir).get("language_model.model.embed_tokens.weight")
    torch.testing.assert_close(model.model.embed_tokens.weight, embed.float(), rtol=0, atol=0)

    experts = store.fetch(1, [0, 3])  # each expert is looked up when indexed
    assert len(experts) == 2 and experts[0] is not None and experts[1] is not None and store.stats.misses == 2


def test_vision_tensors_are_skipped(k3):
    edit_tensors(k3, lambda t: t.update({"vision_tower.blocks.0.attn.weight": torch.ones(4, 4, dtype=torch.bfloat16)}))
    model, _ = load_model(k3)
    assert not any("vision" in n for n, _ in model.named_parameters())


# -- files -----------------------------------------------------------------------------------------


def test_missing_shard_file(k3):
    victim = shard_files(k3)[1]
    victim.unlink()
    msg = load_error(k3)
    assert f"to shard {victim.name!r}, which does not exist" in msg
    assert INDEX_NAME in msg


def test_truncated_shard(k3):
    victim = shard_files(k3)[-1]
    size = victim.stat().st_size
    os.truncate(victim, size - 100)
    msg = load_error(k3)
    assert msg.startswith(f"{victim}: file truncated")
    assert f"actual {size - 100}" in msg


def test_shard_cut_inside_its_header(k3):
    victim = shard_files(k3)[0]
    os.truncate(victim, 4)
    msg = load_error(k3)
    assert msg.startswith(f"{victim}: truncated: expected at least 8 bytes")


def test_index_points_at_a_tensor_the_shard_lacks(k3):
    name = f"{P}.2.self_attn.o_proj.weight"
    edit_tensors(k3, lambda t: t.pop(name), update_index=False)
    msg = load_error(k3)
    assert f"maps tensor {name!r} to {shard_of(k3, name)!r}, but that file's header has no such tensor" in msg


# -- missing tensors -------------------------------------------------------------------------------


def test_missing_dense_tensor(k3):
    name = f"{P}.2.self_attn.o_proj.weight"
    edit_tensors(k3, lambda t: t.pop(name))
    msg = load_error(k3)
    assert msg == f"missing tensors in {k3}: {name}"


def test_missing_model_level_tensor(k3):
    edit_tensors(k3, lambda t: t.pop("language_model.lm_head.weight"))
    assert "missing tensors" in (msg := load_error(k3)) and "language_model.lm_head.weight" in msg


def test_missing_routed_expert_tensor(k3):
    name = f"{P}.3.block_sparse_moe.experts.5.w2.weight_scale"
    edit_tensors(k3, lambda t: t.pop(name))
    msg = load_error(k3)
    assert "missing tensor for layer 3 expert 5 w2: need weight, or weight_packed + weight_scale" in msg


def test_missing_whole_expert(k3):
    def drop(t):
        for key in [n for n in t if n.startswith(f"{P}.2.block_sparse_moe.experts.15.")]:
            del t[key]

    edit_tensors(k3, drop)
    msg = load_error(k3)
    assert "missing routed expert: layer 2 expert 15 has no tensors (config.json says num_experts=16)" in msg


# -- shapes and dtypes -----------------------------------------------------------------------------


def test_misshapen_dense_tensor(k3):
    name = f"{P}.1.block_sparse_moe.routed_expert_down_proj.weight"
    edit_tensors(k3, lambda t: t.update({name: t[name][:, :63]}))
    msg = load_error(k3)
    assert msg == f"{name} in {shard_of(k3, name)}: expected shape [32, 64] from config.json, found [32, 63]"


def test_misshapen_expert_tensor(k3):
    name = f"{P}.4.block_sparse_moe.experts.7.w1.weight_packed"
    edit_tensors(k3, lambda t: t.update({name: t[name][:, :15]}))
    msg = load_error(k3)
    assert msg == (f"{name} in {shard_of(k3, name)} (layer 4 expert 7 w1): expected shape [64, 16] "
                   f"from config.json, found [64, 15]")


def test_packed_expert_stored_as_float(k3):
    name = f"{P}.1.block_sparse_moe.experts.0.w3.weight_packed"
    edit_tensors(k3, lambda t: t.update({name: t[name].float()}))
    msg = load_error(k3)
    assert msg == (f"{name} in {shard_of(k3, name)} (layer 1 expert 0 w3): expected dtype torch.uint8, "
                   f"found torch.float32")


def test_expert_scale_stored_as_int8(k3):
    name = f"{P}.5.block_sparse_moe.experts.2.w2.weight_scale"
    edit_tensors(k3, lambda t: t.update({name: t[name].view(torch.int8)}))
    msg = load_error(k3)
    assert name in msg and "expected dtype torch.uint8, found torch.int8" in msg


def test_dense_weight_stored_as_int(k3):
    name = f"{P}.0.mlp.down_proj.weight"
    edit_tensors(k3, lambda t: t.update({name: torch.zeros(t[name].shape, dtype=torch.int32)}))
    msg = load_error(k3)
    assert msg == f"{name} in {shard_of(k3, name)}: expected a float tensor, found torch.int32"


# -- config that contradicts the tensors -----------------------------------------------------------


def test_hidden_size_changed_in_config(k3):
    edit_config(k3, lambda c: c.update(hidden_size=128))
    name = "language_model.lm_head.weight"  # the first name in sorted order with a hidden-size dimension
    msg = load_error(k3)
    assert msg == f"{name} in {shard_of(k3, name)}: expected shape [512, 128] from config.json, found [512, 64]"


def test_num_experts_increased_in_config_hits_the_router_first(k3):
    edit_config(k3, lambda c: c.update(num_experts=17))
    msg = load_error(k3)
    assert ".block_sparse_moe.gate." in msg
    assert "expected shape [17" in msg and "found [16" in msg


def test_num_experts_increased_with_a_matching_router_finds_the_missing_expert(k3):
    edit_config(k3, lambda c: c.update(num_experts=17))

    def grow_router(t):
        for name in [n for n in t if n.endswith((".gate.weight", ".gate.e_score_correction_bias"))]:
            t[name] = torch.cat([t[name], t[name][:1]])

    edit_tensors(k3, grow_router)
    msg = load_error(k3)
    assert msg.startswith("missing routed expert: layer 1 expert 16 has no tensors")
    assert "num_experts=17" in msg


def test_num_experts_decreased_rejects_the_extra_experts(k3):
    edit_config(k3, lambda c: c.update(num_experts=15))

    def shrink_router(t):
        for name in [n for n in t if n.endswith((".gate.weight", ".gate.e_score_correction_bias"))]:
            t[name] = t[name][:15]

    edit_tensors(k3, shrink_router)
    msg = load_error(k3)
    assert "layer 1 expert 15" in msg and "num_experts=15" in msg


def test_expert_tensors_for_a_dense_layer(k3):
    edit_tensors(k3, lambda t: t.update({f"{P}.0.block_sparse_moe.experts.0.w1.weight_packed":
                                         torch.zeros(64, 16, dtype=torch.uint8)}))
    msg = load_error(k3)
    assert "routed-expert tensors for layer 0, which config.json says is not an MoE layer" in msg


def test_extra_unmapped_tensor(k3):
    name = f"{P}.0.self_attn.rotary_emb.inv_freq"
    edit_tensors(k3, lambda t: t.update({name: torch.ones(8)}))
    msg = load_error(k3)
    assert msg.startswith(f"unmapped tensor {name} in {shard_of(k3, name)}: the kimi_k3 model")
    assert "has no parameter 'model.layers.0.self_attn.rotary_emb.inv_freq'" in msg


def test_extra_expert_tensor_kind_is_unmapped(k3):
    name = f"{P}.1.block_sparse_moe.experts.0.w1.weight_zero_point"
    edit_tensors(k3, lambda t: t.update({name: torch.zeros(64, 1, dtype=torch.uint8)}))
    assert load_error(k3).startswith(f"unmapped tensor {name} ")


def test_unknown_architecture_in_config(k3):
    raw = json.loads((k3 / "config.json").read_text())
    raw.update(model_type="llama", architectures=["LlamaForCausalLM"])
    raw["text_config"].update(model_type="llama", architectures=["LlamaForCausalLM"])
    (k3 / "config.json").write_text(json.dumps(raw))
    msg = load_error(k3, ConfigError)
    assert msg.startswith(f"{k3 / 'config.json'}: unknown architecture (model_type='llama'")
    assert "moeswap runs: kimi_k3, kimi_linear" in msg


def test_missing_config_json(k3):
    (k3 / "config.json").unlink()
    assert "no config.json found" in load_error(k3, ConfigError)


def test_missing_index_and_several_shards(k3):
    (k3 / INDEX_NAME).unlink()
    msg = load_error(k3)
    assert f"expected {INDEX_NAME} or exactly one *.safetensors file" in msg
