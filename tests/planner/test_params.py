"""K3 sizes from the real config against kimi_k3.md §8, and the formulas' generality."""

import json

import pytest

from moeswap.planner.hardware import resolve_hardware
from moeswap.planner.models import parse_model_dict, preset_path, resolve_model
from moeswap.planner.params import kda_state_bytes_per_seq, mla_cache_values_per_token, model_params
from moeswap.planner.plan import model_sizes
from moeswap.planner.workload import Precision

MIB, KIB = 2**20, 1024


def test_k3_parameter_counts_match_section_8(k3p):
    assert k3p.routed == pytest.approx(2.72e12, rel=0.005)
    assert k3p.non_expert == pytest.approx(56.7e9, rel=0.005)
    assert k3p.active == pytest.approx(104.2e9, rel=0.002)
    assert k3p.total == pytest.approx(2.78e12, rel=0.005)
    assert k3p.num_experts_total == 82_432  # 92 MoE layers x 896


def test_k3_expert_bytes_and_totals(k3p):
    sizes = model_sizes(k3p, Precision())
    # w1, w3 [3072, 3584] and w2 [3584, 3072]: packed nibbles + one E8M0 byte per 32 weights
    assert sizes["expert_bytes"] == 17_547_264
    assert sizes["bytes:routed experts"] == pytest.approx(1.45e12, rel=0.005)
    non_expert_bf16 = sum(v for k, v in sizes.items() if k.startswith("bytes:") and k != "bytes:routed experts")
    assert non_expert_bf16 == pytest.approx(113.5e9, rel=0.005)


def test_k3_cache_and_state(k3):
    assert mla_cache_values_per_token(k3) * 2 == 27 * KIB  # 24 layers x 576 x bf16
    state, conv = kda_state_bytes_per_seq(k3)
    assert state == 414 * MIB  # 69 layers x 96 heads x 128 x 128 x fp32
    assert 0 < conv < 20 * MIB


def test_minimum_h200s_for_weights(k3p):
    sizes = model_sizes(k3p, Precision(), resolve_hardware("h200"))
    assert sizes["devices_for_weights"] == pytest.approx(11.1, abs=0.1)  # "≈ 11 H200s"


def test_counts_follow_the_config_not_constants():
    raw = json.loads(preset_path("kimi-k3").read_text())
    base = model_params(parse_model_dict(raw))
    raw["text_config"]["num_experts"] = 448
    raw["text_config"]["moe_intermediate_size"] = 1536
    half = model_params(parse_model_dict(raw))
    assert half.routed == pytest.approx(base.routed / 4)
    assert half.expert_params == base.expert_params // 2


def test_other_architectures():
    cfg, _ = resolve_model("kimi-linear-48b")
    p = model_params(cfg)
    assert p.total == pytest.approx(48e9, rel=0.03)  # "48B-A3B"
    assert p.active == pytest.approx(3e9, rel=0.05)
    ds, _ = resolve_model(str(preset_path("kimi-k3").parent / "deepseek_v3_proxy.json"))
    assert model_params(ds).total == pytest.approx(671e9, rel=0.005)


def test_deepseek_v3_and_kimi_k2_presets_give_the_published_sizes():
    """Their published configs, read by config.py as the deepseek_v3 architecture (shapes from the model on
    meta): DeepSeek-V3 671B total / 37B active (MTP layer excluded), Kimi K2 1T / 32B, both block FP8."""
    for name, total, active, experts in (("deepseek-v3", 671e9, 37e9, 256), ("kimi-k2", 1.03e12, 32e9, 384)):
        cfg, _ = resolve_model(name)
        p = model_params(cfg)
        assert cfg.arch == "deepseek_v3" and cfg.moe.num_experts == experts and cfg.quant.format == "fp8_block"
        assert p.total == pytest.approx(total, rel=0.005)
        assert p.active == pytest.approx(active, rel=0.02)
        assert Precision().for_model(cfg).experts == "fp8"


def test_mxfp4_versus_bf16_experts(k3p):
    assert model_sizes(k3p, Precision(experts="bf16"))["expert_bytes"] / model_sizes(k3p, Precision())["expert_bytes"] \
        == pytest.approx(2 / (0.5 + 1 / 32))


def _configs():
    """A small config of every architecture in the model registry, and every preset the planner ships."""
    from moeswap.archs import REGISTRY
    from moeswap.tiny import tiny_config

    out = [(f"tiny-{arch}", parse_model_dict(tiny_config(arch, "tiny"))) for arch in sorted(REGISTRY)]
    for path in sorted(preset_path("kimi-k3").parent.glob("*.json")):
        out.append((path.stem, resolve_model(str(path))[0]))
    return out


CONFIGS = _configs()


@pytest.mark.parametrize("cfg", [c for _, c in CONFIGS], ids=[label for label, _ in CONFIGS])
def test_counts_equal_the_model_built_on_meta(cfg):
    """Oracle: the model's own modules (its Linears and routers are the matrices, every other parameter a
    vector) and routed_expert_shapes; not the planner's KINDS table."""
    from torch import nn

    from moeswap.config import routed_expert_shapes
    from moeswap.models import build_model
    from moeswap.models.layers.moe import Router

    model = build_model(cfg, device="meta")
    p = model_params(cfg)

    def matrices(module):
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, Router)))

    assert len(p.layers) == len(model.model.layers)
    for lp, layer in zip(p.layers, model.model.layers):
        ff = layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe
        assert lp.attn_params == matrices(layer.self_attn)
        assert lp.mlp_params == matrices(ff)
        assert lp.vectors == sum(x.numel() for x in layer.parameters()) - lp.attn_params - lp.mlp_params
        assert 0 <= lp.vectors_fp32 <= lp.vectors
        assert lp.num_experts == (ff.num_experts if hasattr(layer, "block_sparse_moe") else 0)
    assert p.non_expert == sum(x.numel() for x in model.parameters())
    assert p.embed == model.model.embed_tokens.weight.numel()
    assert p.lm_head == (0 if cfg.tie_word_embeddings else model.lm_head.weight.numel())
    shapes = routed_expert_shapes(cfg)
    assert [(l.name, l.out_dim, l.in_dim) for l in p.expert] == [(k, *v) for k, v in shapes.items()]
    assert p.total == p.non_expert + sum(b.num_experts for b in model.moe_blocks()) * sum(
        o * i for o, i in shapes.values())


def test_a_weight_the_table_does_not_know_is_an_error():
    from moeswap.models import build_model
    from moeswap.planner.errors import PlanError
    from moeswap.planner.params import from_weights

    cfg, _ = resolve_model("kimi-linear-48b")
    weights = [(n, tuple(x.shape)) for n, x in build_model(cfg, device="meta").named_parameters()]
    expert = model_params(cfg).expert
    assert from_weights(cfg, weights, expert).non_expert == model_params(cfg).non_expert
    for extra in (("model.layers.3.self_attn.q_proj.bias", (4096,)), ("model.layers.0.mlp.new_proj.weight", (8, 8))):
        with pytest.raises(PlanError, match=extra[0].removesuffix(".weight").rpartition(".")[2]):
            from_weights(cfg, weights + [extra], expert)
    with pytest.raises(PlanError, match="decoder layers"):  # a matrix outside the layers has no place
        from_weights(cfg, weights + [("model.gate_proj.weight", (8, 8))], expert)
