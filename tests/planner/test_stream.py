"""predict_stream on a real-shape K3 slice (4 layers, K3's widths and 896 experts): its parts against the
formula computed here from the config's shapes."""

import json

import pytest

from moeswap.planner.errors import PlanError
from moeswap.planner.models import parse_model_dict, preset_path
from moeswap.planner.stream import CpuFacts, predict_stream

CPU = CpuFacts(cores=16, mem_bw_gbs=60.0)
EXPERT = 3 * 3072 * 3584 * (0.5 + 1 / 32)  # one MXFP4 expert: w1, w3, w2, an E8M0 scale per 32


@pytest.fixture(scope="module")
def slice4():
    raw = json.loads(preset_path("kimi-k3").read_text())
    t = raw["text_config"]
    t["num_hidden_layers"] = 4  # layer 0 dense MLP + KDA, layers 1-2 KDA + MoE, layer 3 MLA + MoE
    t["linear_attn_config"] = {**t["linear_attn_config"], "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    return parse_model_dict(raw)


def test_prediction_is_dense_plus_experts_plus_missed_bytes_over_drive(slice4):
    fewer, more = (predict_stream(slice4, ram, 3.0, CPU) for ram in (24e9, 48e9))
    for p in (fewer, more):
        assert p.expert_bytes_total == pytest.approx(3 * 896 * EXPERT)  # 3 MoE layers
        assert p.hit_rate == pytest.approx(p.expert_cache_bytes / p.expert_bytes_total)
        # batch 1: each MoE layer routes to 16 experts, each missing with probability 1 - hit
        assert p.missed_bytes_per_token == pytest.approx(3 * 16 * (1 - p.hit_rate) * EXPERT)
        assert p.drive_s == pytest.approx(p.missed_bytes_per_token / 3e9)  # measured rate: used as is
        assert p.s_per_token == pytest.approx(p.dense_s + p.expert_compute_s + p.drive_s)
    # 24 GB more RAM caches 24 GB more experts; the dense part and expert compute do not change
    assert more.expert_cache_bytes - fewer.expert_cache_bytes == pytest.approx(24e9 * (1 - 0.10))  # less reserve
    assert more.dense_s == pytest.approx(fewer.dense_s) and more.expert_compute_s == pytest.approx(fewer.expert_compute_s)
    assert more.s_per_token < fewer.s_per_token


def test_expert_memory_sets_the_cache(slice4):
    p = predict_stream(slice4, 24e9, 3.0, CPU, expert_memory=2e9)
    assert p.expert_cache_bytes == pytest.approx(2e9)
    assert p.drive_s == pytest.approx(3 * 16 * (1 - 2e9 / (3 * 896 * EXPERT)) * EXPERT / 3e9)
    with pytest.raises(PlanError, match="does not fit"):
        predict_stream(slice4, 24e9, 3.0, CPU, expert_memory=20e9)
