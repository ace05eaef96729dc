"""`--hardware local` on a CPU: with fixed measured constants, a decode step is the documented formula
(dense bf16 bytes / kernel rate + experts' bytes, rows and engine time + eager ops x time per op), and
the op counts from the engine profile are what the overhead uses. No timing here."""

import pytest

from moeswap.config import parse_config
from moeswap.planner.hardware import builtin_catalog, resolve_hardware
from moeswap.planner.layouts import Layout
from moeswap.planner.local_cpu import per_layer_counts
from moeswap.planner.params import model_params
from moeswap.planner.roofline import Pass, Placement, stage_cost
from moeswap.planner.workload import Precision
from moeswap.tiny import tiny_config

COPY_GBS = 20.0
ENGINE = dict(mem_efficiency=1.2, expert_mem_efficiency=0.7, expert_us=8.0, expert_row_ns=15.0, kernel_us=6.0,
              kernels_kda=67, kernels_mla=127, kernels_dense=24, kernels_moe=59, kernels_attn_res=30,
              kernels_step=45, gemm_efficiency=1.0, gemm_half_m=0, gemm_half_n=0, lowbit_gemm_efficiency=1.0)


def cpu_catalog(tmp_path, **engine):
    """A one-CPU system on the moeswap-cpu profile with fixed numbers: what `--hardware local` would measure.
    The eager engine's terms unless `native_layer_us` is given (the native decode step's)."""
    base = {k: v for k, v in builtin_catalog().get("engine", "moeswap-cpu").fields.items()
            if k not in ("name", "native_layer_us")}
    fields = {**base, **ENGINE, **engine}
    lines = ['[accelerator.cpu]', 'name = "cpu"', 'memory_gb = 64', f'mem_bw_gbs = {COPY_GBS}',
             'bf16_tflops = 1000', '[accelerator.cpu.source]', 'memory_gb = "t"', 'mem_bw_gbs = "t"',
             'bf16_tflops = "t: high, so that FLOPs never bind at batch 1"',
             '[engine.cpu]', 'name = "cpu"', *[f"{k} = {v}" for k, v in fields.items()], '[engine.cpu.source]',
             *[f'{k} = "t"' for k in fields],
             '[system.cpu]', 'name = "cpu"', 'accelerator = "cpu"', 'scale_up_link = "none"',
             'scale_out_link = "none"', 'host_link = "none"', 'host = "none"', 'storage = "nvme-gen4"',
             'engine = "cpu"', 'node_devices = 1', 'scale_up_devices = 1', 'drives_per_node = 1',
             '[system.cpu.source]', 'node_devices = "t"', 'scale_up_devices = "t"', 'drives_per_node = "t"']
    path = tmp_path / "cpu.toml"
    path.write_text("\n".join(lines) + "\n")
    cat = builtin_catalog()
    cat.add_file(path)
    return resolve_hardware("cpu", cat)


@pytest.fixture(scope="module")
def bench():
    return model_params(parse_config(tiny_config("kimi_k3", "bench")))


def decode_step(mp, hw):
    return stage_cost(mp, range(len(mp.layers)), 0, Layout(), hw, Precision(), Placement(),
                      Pass(tokens=1, ctx=144, decode=True, logits=1))


def test_decode_step_is_the_measured_formula(bench, tmp_path):
    hw = cpu_catalog(tmp_path)
    cost = decode_step(bench, hw)
    cfg, moe, e = bench.cfg, bench.cfg.moe, ENGINE
    linears = [l for lp in bench.layers for l in (*lp.attn, *lp.mlp)]
    dense_bytes = sum(2 * l.params + 2 * (l.in_dim + l.out_dim) for l in linears)  # bf16 weights + activations
    dense_bytes += 2 * bench.lm_head + 2 * (cfg.hidden_size + cfg.vocab_size)
    assert cost.parts["gemm"] == pytest.approx(dense_bytes / (COPY_GBS * 1e9 * e["mem_efficiency"]))

    moe_layers = sum(1 for lp in bench.layers if lp.num_experts)
    width = moe.latent_dim
    expert_bytes = bench.expert_params * 17 / 32 + 2 * (2 * width + 5 * moe.expert_dim)  # MXFP4 + activations
    per_expert = (expert_bytes / (COPY_GBS * 1e9 * e["expert_mem_efficiency"]) + e["expert_us"] * 1e-6
                  + (2 * moe.expert_dim + width) * e["expert_row_ns"] * 1e-9)
    assert cost.parts["experts"] == pytest.approx(moe_layers * moe.top_k * per_expert)

    kinds = [lp.attn_kind for lp in bench.layers]
    ops = (kinds.count("kda") * e["kernels_kda"] + kinds.count("mla") * e["kernels_mla"]
           + moe_layers * e["kernels_moe"] + (len(kinds) - moe_layers) * e["kernels_dense"]
           + len(kinds) * e["kernels_attn_res"] + e["kernels_step"])
    assert cost.parts["overhead"] == pytest.approx(ops * e["kernel_us"] * 1e-6)
    # what is left (attention core on the state and cache, norms' traffic) is small at batch 1
    rest = cost.total - cost.parts["gemm"] - cost.parts["experts"] - cost.parts["overhead"]
    assert 0 < rest < 0.01 * cost.total


def test_engine_profile_counts_are_consumed(bench, tmp_path):
    base = decode_step(bench, cpu_catalog(tmp_path)).parts["overhead"]
    moe_layers = sum(1 for lp in bench.layers if lp.num_experts)
    more_moe = decode_step(bench, cpu_catalog(tmp_path, kernels_moe=ENGINE["kernels_moe"] + 10)).parts["overhead"]
    assert more_moe - base == pytest.approx(10 * moe_layers * ENGINE["kernel_us"] * 1e-6)
    more_step = decode_step(bench, cpu_catalog(tmp_path, kernels_step=ENGINE["kernels_step"] + 100)).parts["overhead"]
    assert more_step - base == pytest.approx(100 * ENGINE["kernel_us"] * 1e-6)  # once per pass, not per layer


def test_gpu_profile_has_none_of_the_cpu_terms(k3p):
    eng = resolve_hardware("h200").engine
    assert all(eng.get(k) is None for k in ("expert_mem_efficiency", "expert_us", "expert_row_ns", "kernels_step"))


class _Layer:
    def __init__(self, kind: str, dense: bool):
        self.attn_kind = kind
        if dense:
            self.mlp = object()


class _Model:
    def __init__(self, layers):
        self.model = type("Inner", (), {"layers": layers})()


def test_per_layer_counts_divide_by_layers_of_each_kind():
    model = _Model([_Layer("kda", True), _Layer("kda", False), _Layer("kda", False), _Layer("mla", False)])
    per_step = {"kda": 300, "mla": 127, "dense": 24, "moe": 177, "layer": 120, "step": 45}
    assert per_layer_counts(model, per_step) == {"kernels_kda": 100, "kernels_mla": 127, "kernels_dense": 24,
                                                 "kernels_moe": 59, "kernels_attn_res": 30, "kernels_step": 45}


def test_cached_op_time_only_where_a_step_fits_in_the_cache(bench, tmp_path):
    cold = decode_step(bench, cpu_catalog(tmp_path)).parts["overhead"]
    fits = decode_step(bench, cpu_catalog(tmp_path, kernel_us_cached=2.0, cache_mb=1e6)).parts["overhead"]
    too_big = decode_step(bench, cpu_catalog(tmp_path, kernel_us_cached=2.0, cache_mb=32)).parts["overhead"]
    assert fits == pytest.approx(cold * 2.0 / ENGINE["kernel_us"]) and too_big == cold  # 317 MB a step > 32 MB


def test_native_step_replaces_layer_ops_and_engine_expert_time_at_decode(bench, tmp_path):
    eager_hw, native_hw = cpu_catalog(tmp_path), cpu_catalog(tmp_path, native_layer_us=15.0)
    eager, native = decode_step(bench, eager_hw), decode_step(bench, native_hw)
    e, moe = ENGINE, bench.cfg.moe
    assert native.parts["overhead"] == pytest.approx((len(bench.layers) * 15.0 + e["kernels_step"] * e["kernel_us"]) * 1e-6)
    moe_layers = sum(1 for lp in bench.layers if lp.num_experts)
    assert eager.parts["experts"] - native.parts["experts"] == pytest.approx(moe_layers * moe.top_k * e["expert_us"] * 1e-6)
    assert native.parts["gemm"] == eager.parts["gemm"]

    def overhead(hw, tokens: int, placement=Placement()):
        return stage_cost(bench, range(len(bench.layers)), 0, Layout(), hw, Precision(), placement,
                          Pass(tokens=tokens, ctx=144, decode=True, logits=tokens)).parts["overhead"]

    # more sequences than the native step takes: the eager engine's terms; experts that swap: the MoE
    # blocks' eager ops on top of the native layers (the model runs those FFNs between native calls)
    assert overhead(native_hw, 64) == overhead(eager_hw, 64)
    swap = Placement(hit_rate=0.5)
    assert overhead(native_hw, 1, swap) == pytest.approx(
        (len(bench.layers) * 15.0 + moe_layers * e["kernels_moe"] * e["kernel_us"] + e["kernels_step"] * e["kernel_us"])
        * 1e-6)
