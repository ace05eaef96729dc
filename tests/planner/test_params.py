"""K3 sizes from the real config against kimi_k3.md §8, and the formulas' generality."""

import json

import pytest

from moeswap.planner.models import parse_model_dict, preset_path, resolve_model
from moeswap.planner.params import kda_state_bytes_per_seq, mla_cache_values_per_token, model_params
from moeswap.planner.plan import model_sizes
from moeswap.planner.hardware import resolve_hardware
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


def test_mxfp4_versus_bf16_experts(k3p):
    assert model_sizes(k3p, Precision(experts="bf16"))["expert_bytes"] / model_sizes(k3p, Precision())["expert_bytes"] \
        == pytest.approx(2 / (0.5 + 1 / 32))
