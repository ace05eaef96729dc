"""Memory per device: component sizes, TP/DCP sharding, spill placement, LoRA state."""

import pytest

from moeswap.planner.hardware import builtin_catalog, resolve_hardware
from moeswap.planner.layouts import Layout, stage_layers
from moeswap.planner.memory import device_memory
from moeswap.planner.workload import Lora, Offload, Precision

H200 = resolve_hardware("h200")


def mem(k3p, lay, off=Offload(), **kw):
    layers = stage_layers(k3p.cfg, lay.pp)[0]
    return device_memory(k3p, lay, 0, layers, H200, Precision(), off, **kw)


def test_k3_does_not_fit_8_h200_and_says_why(k3p):
    m = mem(k3p, Layout(tp=8), seqs=1, ctx=9216)
    assert m.problem and "routed experts need" in m.problem and "--spill host" in m.problem


def test_k3_fits_16_h200(k3p):
    m = mem(k3p, Layout(tp=8, pp=2), seqs=1, ctx=9216)
    assert m.problem is None and m.resident_fraction == 1.0
    assert m.used < m.capacity


def test_state_scaling_with_tp_and_dcp(k3p):
    base = mem(k3p, Layout(tp=8, pp=2), seqs=4, ctx=9216)
    dcp = mem(k3p, Layout(tp=8, pp=2, dcp=True), seqs=4, ctx=9216)
    tp4 = mem(k3p, Layout(tp=4, pp=4), seqs=4, ctx=9216)
    assert dcp.parts["MLA cache"] == pytest.approx(base.parts["MLA cache"] / 8)
    # KDA state splits by heads: per-layer state per device doubles from TP8 to TP4
    per_layer = lambda m, n: m.parts["KDA state"] / n
    n_kda = lambda lay: sum(1 for i in stage_layers(k3p.cfg, lay.pp)[0] if k3p.cfg.attn_kinds[i] == "kda")
    assert per_layer(tp4, n_kda(Layout(pp=4))) == pytest.approx(2 * per_layer(base, n_kda(Layout(pp=2))))
    assert base.parts["MLA cache"] == pytest.approx(4 * 9216 * 12 * 576 * 2)  # 12 MLA layers in stage 0


def test_spill_to_host_places_experts(k3p):
    m = mem(k3p, Layout(tp=8), Offload(spill="host"), seqs=1, ctx=9216, ws_tokens=1)
    assert m.problem is None
    assert 0 < m.resident_fraction < 1
    assert m.expert_resident + m.expert_host == pytest.approx(m.expert_need)
    assert m.used == pytest.approx(m.capacity)


def test_spill_uses_the_whole_host_and_shares_copies(k3p):
    m = mem(k3p, Layout(tp=1), Offload(spill="host"), seqs=1, ctx=4096, ws_tokens=1)
    assert m.problem is None and m.expert_host > 1.3e12  # one device may use the server's 2 TB
    # 8 one-device replicas on one server hold the same experts: one host copy serves them all
    assert mem(k3p, Layout(tp=1, replicas=8), Offload(spill="host"), seqs=1, ctx=4096, ws_tokens=1).problem is None


def test_spill_beyond_host_needs_nvme(k3p, tmp_path):
    f = tmp_path / "small_host.toml"
    f.write_text('[host.xeon-spr-2s-2tb]\nname = "small"\nmemory_gb = 512\nmem_bw_gbs = 614\nmem_efficiency = 0.78\n'
                 '[host.xeon-spr-2s-2tb.source]\nmemory_gb = "t"\nmem_bw_gbs = "t"\nmem_efficiency = "t"\n')
    cat = builtin_catalog()
    cat.add_file(f)
    hw = resolve_hardware("h200", cat)
    layers = stage_layers(k3p.cfg, 1)[0]
    args = (k3p, Layout(tp=1), 0, layers, hw, Precision())
    m = device_memory(*args, Offload(spill="host"), seqs=1, ctx=4096, ws_tokens=1)
    assert "--spill nvme" in m.problem
    m = device_memory(*args, Offload(spill="nvme"), seqs=1, ctx=4096, ws_tokens=1)
    # the host keeps the engine's reserve (2 GB + 5 % of its RAM) for the OS and the runtime
    host = 512e9 - 2e9 - 0.05 * 512e9
    assert m.problem is None and m.expert_host == pytest.approx(host)
    assert m.expert_nvme == pytest.approx(m.expert_need - m.expert_resident - host)


def test_lora_state_bytes(k3p):
    lora = Lora(rank=16, targets=("attn",), seq_len=4096)
    m = mem(k3p, Layout(tp=8, pp=2), lora=lora)
    assert m.parts["optimizer state (Adam)"] == pytest.approx(2 * m.parts["LoRA adapters (fp32)"])
    assert m.parts["adapter grads (fp32)"] == m.parts["LoRA adapters (fp32)"]
    # rank 16 on the attention of 48 layers, split 8 ways: tens of MB, not GB
    assert 10e6 < m.parts["LoRA adapters (fp32)"] < 200e6
    with_experts = mem(k3p, Layout(tp=8, pp=2), lora=Lora(rank=16, targets=("attn", "experts")))
    assert with_experts.parts["LoRA adapters (fp32)"] > 10 * m.parts["LoRA adapters (fp32)"]
    assert m.parts["checkpoints"] == pytest.approx(2 * 4096 * (48 + 8) * 7168 * 2)  # pp - stage = 2 in flight
