"""Roofline behaviour: what bounds decode, monotonicity, collectives, swap traffic."""

import pytest

from moeswap.planner.hardware import builtin_catalog, resolve_hardware
from moeswap.planner.layouts import Layout, stage_layers
from moeswap.planner.roofline import Pass, Placement, all_reduce, stage_cost, touched_fraction
from moeswap.planner.workload import Precision


def decode(k3p, hw, c, lay=Layout(tp=8, pp=2), pl=Placement()):
    layers = stage_layers(k3p.cfg, lay.pp)[0]
    return stage_cost(k3p, layers, 0, lay, hw, Precision(), pl, Pass(c, 9000, True, c))


def test_touched_fraction():
    assert touched_fraction(1, 16, 896) == pytest.approx(16 / 896)
    assert touched_fraction(10_000, 16, 896) == pytest.approx(1.0)
    skewed = tuple([0.5] + [0.5 / 895] * 895)
    assert touched_fraction(8, 16, 896, skewed) < touched_fraction(8, 16, 896)


def test_decode_at_batch_one_is_not_compute_bound(k3p):
    cost = decode(k3p, resolve_hardware("h200"), 1)
    flops_time = 2 * k3p.active / 16 / 989e12  # a perfect-compute floor, far below the step
    assert cost.total > 50 * flops_time
    assert cost.parts["overhead"] > 0 and cost.parts["comm"] > 0


def test_step_time_grows_with_concurrency(k3p):
    hw = resolve_hardware("h200")
    times = [decode(k3p, hw, c).total for c in (1, 4, 16, 64, 256)]
    assert times == sorted(times) and times[-1] > 2 * times[0]


def test_more_bandwidth_means_faster_decode(k3p, tmp_path):
    f = tmp_path / "fast.toml"
    f.write_text('[accelerator.nvidia-h200]\nname = "2x bw"\nmemory_gb = 141\nmem_bw_gbs = 9600\nbf16_tflops = 989\n'
                 '[accelerator.nvidia-h200.source]\nmemory_gb = "t"\nmem_bw_gbs = "t"\nbf16_tflops = "t"\n')
    cat = builtin_catalog()
    cat.add_file(f)
    slow, fast = decode(k3p, resolve_hardware("h200"), 16), decode(k3p, resolve_hardware("h200", cat), 16)
    assert fast.parts["experts"] < 0.6 * slow.parts["experts"]  # memory-bound: close to halved
    assert fast.parts["overhead"] == slow.parts["overhead"]


def test_all_reduce_alpha_beta():
    hw = resolve_hardware("h200")
    assert all_reduce(hw, 1, 1e9) == 0
    small, big = all_reduce(hw, 8, 1e3), all_reduce(hw, 8, 1e9)
    assert small == pytest.approx(10e-6, rel=0.01)
    assert big == pytest.approx(10e-6 + 2 * 7 / 8 * 1e9 / (450e9 * 0.7), rel=1e-6)
    assert all_reduce(hw, 16, 1e9) > big  # crosses the 8-GPU NVLink domain onto the NICs


def test_swap_time_follows_hit_rate(k3p):
    hw = resolve_hardware("h200")
    miss = decode(k3p, hw, 16, pl=Placement(hit_rate=0.5))
    hit = decode(k3p, hw, 16, pl=Placement(hit_rate=1.0))
    assert "swap" not in hit.parts and miss.parts["swap"] > 0
    hidden = decode(k3p, hw, 16, pl=Placement(hit_rate=0.5, swap_overlap=1.0))
    assert hidden.parts["swap"] < miss.parts["swap"]
    # bytes: touched experts x misses x expert bytes / expert-TP, over PCIe at 80 % of 63 GB/s
    touched = 896 * touched_fraction(16, 16, 896)
    expect = 47 * touched * 0.5 * 17_547_264 / 8 / (63e9 * 0.8)
    assert miss.parts["swap"] == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("tokens, same_as", [(1, "host"), (31, "host"), (32, "swap"), (8192, "swap")])
def test_auto_offload_compute_is_the_runtimes_rule(k3p, tokens, same_as):
    """--offload-compute auto costs a pass as the runtime's --expert-compute auto runs it: misses on the
    host below options.EXPERT_GPU_MIN_TOKENS tokens, swapped into HBM from there."""
    from moeswap.options import EXPERT_GPU_MIN_TOKENS

    assert EXPERT_GPU_MIN_TOKENS == 32
    hw, lay = resolve_hardware("h200"), Layout(tp=8, pp=2)
    layers = stage_layers(k3p.cfg, lay.pp)[0]

    def cost(compute):
        pl = Placement(hit_rate=0.5, compute=compute)
        return stage_cost(k3p, layers, 0, lay, hw, Precision(), pl, Pass(tokens, 9000, tokens < 64, tokens)).parts

    auto, want, other = cost("auto"), cost(same_as), cost("swap" if same_as == "host" else "host")
    assert auto == want and auto != other
