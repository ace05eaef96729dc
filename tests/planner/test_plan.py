"""The Python API end to end: ranking, objectives, rejections with reasons, LoRA, traces."""

import json

import pytest

from moeswap.planner import Lora, Offload, PlanError, PlanRequest, Serve, plan
from moeswap.planner.models import preset_path

SERVE = Serve(isl=8192, osl=1024, concurrency=(1, 16, 64))


@pytest.fixture(scope="module")
def h200x16():
    return plan(PlanRequest(hardware="h200", devices=16, serve=SERVE))


def test_ranked_by_throughput(h200x16):
    scores = [c.score for c in h200x16.candidates]
    assert scores == sorted(scores, reverse=True)
    assert all(c.worst_memory.used <= c.worst_memory.capacity for c in h200x16.candidates)
    best = h200x16.best.points
    assert best[-1].tok_s_device > best[0].tok_s_device  # batching pays
    assert best[-1].tpot > best[0].tpot


def test_rejections_carry_reasons(h200x16):
    why = dict(h200x16.rejected)
    assert "exceeds the 8 12-layer AttnRes blocks" in why["PP16×TP1"]
    assert any("routed experts need" in w for w in why.values())


def test_latency_objective_orders_by_tpot():
    r = plan(PlanRequest(hardware="h200", devices=16, serve=SERVE, objective="latency"))
    assert [c.score for c in r.candidates] == sorted(c.score for c in r.candidates)
    assert r.best.score == pytest.approx(r.best.points[0].tpot * 1e3)


def test_cost_objective_needs_a_price():
    with pytest.raises(PlanError, match="--price-per-hour"):
        plan(PlanRequest(hardware="h200", devices=16, objective="cost"))
    r = plan(PlanRequest(hardware="h200", devices=16, serve=SERVE, objective="cost", price_per_hour=3.0))
    p = max((p for p in r.best.points if p.fits), key=lambda p: p.tok_s_device)
    assert r.best.score == pytest.approx(3.0 / 3600 / p.out_tok_s_device * 1e6)


def test_explicit_impossible_layouts():
    with pytest.raises(PlanError, match=r"layout TP8 rejected: .*96 KDA heads|uses 8 devices"):
        plan(PlanRequest(hardware="h200", devices=16, layout="tp8"))
    with pytest.raises(PlanError, match=r"no layout of kimi-k3 fits 8 x h200: stage 0: routed experts need"):
        plan(PlanRequest(hardware="h200", devices=8, layout="tp8"))
    with pytest.raises(PlanError, match="no layout of kimi-k3 fits 4 x h200"):
        plan(PlanRequest(hardware="h200", devices=4))


def test_published_deployment_fits():
    r = plan(PlanRequest(hardware="h200", devices=32, layout="pp4xtp8", serve=SERVE))
    assert r.best.layout.name == "PP4×TP8" and r.best.max_concurrency > 64


def test_config_missing_a_field(tmp_path):
    raw = json.loads(preset_path("kimi-k3").read_text())
    del raw["text_config"]["hidden_size"]
    f = tmp_path / "config.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(PlanError, match="required field 'hidden_size' is missing"):
        plan(PlanRequest(model=str(f), hardware="h200", devices=16))
    with pytest.raises(PlanError, match="neither a preset"):
        plan(PlanRequest(model="kimi-k9", hardware="h200", devices=16))


def test_spill_makes_small_deployments_possible_but_slow():
    small = plan(PlanRequest(hardware="h200", devices=8, layout="tp8", serve=Serve(2048, 256, (1, 8)),
                             offload=Offload(spill="host")))
    big = plan(PlanRequest(hardware="h200", devices=16, layout="pp2xtp8", serve=Serve(2048, 256, (1, 8))))
    c = small.best
    assert 0 < c.hit_rate < 1 and c.worst_memory.expert_host > 0
    assert c.points[0].tpot > 2 * big.best.points[0].tpot
    forced = plan(PlanRequest(hardware="h200", devices=8, layout="tp8", serve=Serve(2048, 256, (1, 8)),
                              offload=Offload(spill="host", hit_rate=0.99)))
    assert forced.best.points[0].tpot < c.points[0].tpot


def test_trace_hit_rate_beats_uniform():
    skewed = tuple(tuple([1000.0] * 100 + [1.0] * 796) for _ in range(93))
    req = dict(hardware="h200", devices=8, layout="tp8", serve=Serve(2048, 256, (8,)))
    uniform = plan(PlanRequest(**req, offload=Offload(spill="host"))).best.hit_rate
    traced = plan(PlanRequest(**req, offload=Offload(spill="host", trace_counts=skewed))).best.hit_rate
    assert traced > uniform
    with pytest.raises(PlanError, match="--trace lists 2 layers; the model has 93"):
        plan(PlanRequest(**req, offload=Offload(spill="host", trace_counts=skewed[:2])))


def test_lora_on_128_cards_without_spilling():
    r = plan(PlanRequest(hardware="atlas-950-superpod", devices=128, workload="lora",
                         lora=Lora(rank=16, seq_len=4096, grad_accum=16)))
    best = r.best
    assert all(m.resident_fraction == 1 for m in best.memory)
    assert best.lora.tok_s > 0 and best.lora.swap_bytes_device == 0
    seqs = max(1, best.layout.dp)  # at least one sequence per attention-DP rank
    assert best.lora.tokens_per_step == best.layout.replicas * 16 * 4096 * seqs


def test_lora_with_host_spill_reports_swap_traffic():
    r = plan(PlanRequest(hardware="atlas-950-superpod", devices=8, layout="pp8", workload="lora",
                         lora=Lora(rank=16, seq_len=4096, grad_accum=8), offload=Offload(spill="host")))
    p = r.best.lora
    assert p.swap_bytes_device > 0 and p.step_s_no_reuse > p.step_s


def test_bad_workload_values():
    with pytest.raises(PlanError, match="--concurrency"):
        plan(PlanRequest(hardware="h200", devices=16, serve=Serve(concurrency=())))
    with pytest.raises(PlanError, match="--lora-targets"):
        plan(PlanRequest(hardware="h200", devices=16, workload="lora", lora=Lora(targets=("router",))))
