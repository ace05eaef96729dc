"""Target selection (PEFT's suffix and regex rules on checkpoint names), freezing, detaching, fusion."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeswap.engine.scheduler import fuse_projections
from moeswap.lora import LoRAConfig, attach_lora, detach_lora, lora_modules, resolve_targets, trainable_parameters
from moeswap.lora.layer import LoRALinear
from moeswap.models.layers.basic import fused_weight


def linear_names(model, leaf: str) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rpartition(".")[2] == leaf]


def test_suffixes_select_by_whole_name_parts(load, tiny_k3_dir):
    model = load(tiny_k3_dir)
    got = resolve_targets(model, ("q_proj", "kv_b_proj", "shared_experts.gate_proj", "lm_head"))
    shared = [n for n in linear_names(model, "gate_proj") if ".shared_experts." in n]
    want = linear_names(model, "q_proj") + linear_names(model, "kv_b_proj") + shared + ["lm_head"]
    assert sorted(got.linears) == sorted(want) and not got.experts
    assert "model.layers.0.mlp.gate_proj" not in got.linears  # the dense MLP's gate is not a shared expert's
    assert not any(n.endswith("q_a_proj") or n.endswith("routed_expert_down_proj") for n in got.linears)
    assert len(shared) == 5 and len(linear_names(model, "q_proj")) == 4


def test_regex_full_matches(load, tiny_k3_dir):
    model = load(tiny_k3_dir)
    got = resolve_targets(model, r"model\.layers\.[0-2]\.self_attn\.(q|k)_proj")
    assert got.linears == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(3) for p in "qk"]
    # the checkpoint's weight prefix (K3: language_model.) may be part of a regex too
    assert resolve_targets(model, r"language_model\.model\.layers\.0\.self_attn\.q_proj", "language_model.").linears \
        == ["model.layers.0.self_attn.q_proj"]


def test_a_pattern_matching_nothing_is_named_with_candidates(load, tiny_k3_dir):
    model = load(tiny_k3_dir)
    with pytest.raises(ValueError, match=r"LoRA target 'qproj' matches no module of this model; candidates: q_proj"):
        resolve_targets(model, ("q_proj", "qproj"))
    with pytest.raises(ValueError, match=r"matches no module"):
        resolve_targets(model, r"model\.layers\.99\..*")


def test_non_linear_targets_are_refused(load, tiny_k3_dir):
    model = load(tiny_k3_dir)
    with pytest.raises(ValueError, match=r"not Linear layers: model\.layers\.1\.block_sparse_moe\.gate \(Router\)"):
        resolve_targets(model, ("gate",))


def test_routed_experts(load, tiny_k3_dir):
    model = load(tiny_k3_dir)
    with pytest.raises(ValueError, match=r"4 of the 16 routed experts' w1 in model\.layers\.1\.block_sparse_moe"):
        resolve_targets(model, r".*\.experts\.[0-3]\.w1")
    got = resolve_targets(model, ("w1", "w3"))
    assert got.experts == {f"model.layers.{i}.block_sparse_moe": ("w1", "w3") for i in range(1, 6)}


def test_only_lora_parameters_train(load, tiny_k3_dir):
    model = load(tiny_k3_dir)
    for p in model.parameters():
        p.requires_grad_(True)  # whatever the caller left: attach freezes the base
    targets = attach_lora(model, LoRAConfig(r=2, target_modules=("q_proj", "o_proj", "routed_expert_up_proj")))
    names = trainable_parameters(model)
    assert sorted(names) == sorted(f"{n}.lora_{p}.weight" for n in targets.linears for p in "AB")
    assert not model.moe_blocks()[0].gate.weight.requires_grad
    assert all(isinstance(m, LoRALinear) for m in lora_modules(model).values())
    with pytest.raises(ValueError, match="already carries a LoRA adapter"):
        attach_lora(model, LoRAConfig(target_modules=("k_proj",)))


def test_peft_init_changes_nothing_and_detach_restores(load, tiny_k3_dir, tokens, randomize_b):
    model = load(tiny_k3_dir)
    originals = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        base = model(tokens)
    attach_lora(model, LoRAConfig(r=4, target_modules=("q_proj", "kv_b_proj", "gate_proj", "lm_head")))
    with torch.no_grad():
        assert torch.equal(model(tokens), base)  # B = 0
        randomize_b(model)
        assert (model(tokens) - base).abs().max() > 0.1
    detach_lora(model)
    assert {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)} == originals
    with torch.no_grad():
        assert torch.equal(model(tokens), base)
    assert model.lora_config is None


ONE_Q = LoRAConfig(r=4, target_modules=("model.layers.0.self_attn.q_proj",))


def test_fusion_respects_lora(load, tiny_k3_dir, tokens, randomize_b):
    """A module whose input projections include a LoRA is left unfused (the others fuse), and a fusion made
    before the LoRA stops applying: the adapted model computes the same bits either way (42 rows: prefill's
    GEMM, where fused modules run one product a projection, as unfused ones do)."""
    model = load(tiny_k3_dir)
    attach_lora(model, ONE_Q, generator=torch.Generator().manual_seed(0))
    randomize_b(model)
    with torch.no_grad():
        want = model(tokens)
        fuse_projections(model)
        kda0, kda1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        assert fused_weight(kda0, kda0.input_projections()) is None
        assert fused_weight(kda1, kda1.input_projections()) is not None
        assert torch.equal(model(tokens), want)

    fused = load(tiny_k3_dir)
    fuse_projections(fused)
    attach_lora(fused, ONE_Q, generator=torch.Generator().manual_seed(0))
    randomize_b(fused)
    kda0 = fused.model.layers[0].self_attn
    assert fused_weight(kda0, kda0.input_projections()) is None
    with torch.no_grad():
        assert torch.equal(fused(tokens), want)


def test_a_fused_weight_being_trained_is_not_read_fused(load, tiny_k3_dir):
    """The fused tensor is a detached copy: under autograd a trained projection weight goes through its module."""
    model = load(tiny_k3_dir)
    fuse_projections(model)
    kda = model.model.layers[1].self_attn
    kda.k_proj.weight.requires_grad_(True)
    with torch.no_grad():
        assert fused_weight(kda, kda.input_projections()) is not None
    assert fused_weight(kda, kda.input_projections()) is None
    x = torch.randn(1, 5, model.config.hidden_size)
    kda(x).sum().backward()
    assert kda.k_proj.weight.grad is not None and kda.k_proj.weight.grad.abs().sum() > 0
