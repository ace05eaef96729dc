"""One box: experts that fit in neither the device nor host RAM are read from the drive at its rate, and
the decode step pays for it as the planner's formula says (docs/planner.md, "Experts on the drive")."""

import re

import pytest

from moeswap.planner.box import add_box, parse_box
from moeswap.planner.cli import main
from moeswap.planner.hardware import builtin_catalog
from moeswap.planner.memory import expert_bytes
from moeswap.planner.plan import PlanRequest, plan
from moeswap.planner.workload import Offload, Precision, Serve


def one_box(spec: str, compute: str = "swap", dense: str = "int4"):
    cat = builtin_catalog()
    hw = add_box(cat, parse_box(spec))
    req = PlanRequest(model="kimi-k3", hardware=hw, devices=1, layout="tp1",
                      serve=Serve(isl=512, osl=64, concurrency=(1,)), precision=Precision(dense=dense),
                      offload=Offload(spill="nvme", compute=compute))
    return plan(req, cat)


def drive_seconds(r) -> float:
    """The formula, from the plan's placement: per token, each MoE layer's top_k experts miss with
    probability 1 - resident fraction (flat routing); the drive holds expert_nvme of the missed bytes
    and reads them at read_gbs x storage_efficiency."""
    c, mp = r.best, r.params
    m = c.memory[0]
    moe_layers = sum(1 for lp in mp.layers if lp.num_experts)
    missed = moe_layers * r.cfg.moe.top_k * (1 - m.expert_resident / m.expert_need) * expert_bytes(mp, r.request.precision)
    on_drive = m.expert_nvme / (m.expert_host + m.expert_nvme)
    return missed * on_drive / (r.hardware.storage.read_gbs * 1e9 * r.hardware.engine.storage_efficiency)


@pytest.mark.parametrize("compute", ["swap", "host"])
def test_gpu_box_drive_charge_follows_ram_and_drive(compute):
    base = "cores=16,mem_bw=100GB/s,gpu=h100"
    runs = {(ram, drive): one_box(f"{base},ram={ram}GB,drive={drive}GB/s", compute)
            for ram, drive in ((64, 7), (512, 7), (512, 14))}
    for r in runs.values():
        assert r.best.decode_cost.parts["drive"] == pytest.approx(drive_seconds(r), rel=1e-9)
    small, big, fast = runs[64, 7], runs[512, 7], runs[512, 14]
    assert small.best.memory[0].expert_nvme > big.best.memory[0].expert_nvme  # more RAM: fewer experts on the drive
    assert fast.best.decode_cost.parts["drive"] == pytest.approx(big.best.decode_cost.parts["drive"] / 2)
    step = lambda r: r.best.points[0].step
    assert step(small) > step(big) > step(fast)
    # the drive dominates: a 64 GB host leaves ~96 % of K3's 1.45 TB of experts on a 7 GB/s drive
    assert small.best.decode_cost.parts["drive"] > 3.0


def test_cpu_box_drive_charge_and_sum():
    r = {ram: one_box(f"cores=16,ram={ram}GB,drive=7GB/s") for ram in (128, 256, 512)}
    for x in r.values():
        c = x.best
        assert c.memory[0].expert_host == 0 and c.memory[0].expert_nvme > 0
        assert c.decode_cost.parts["drive"] == pytest.approx(drive_seconds(x), rel=1e-9)
        # decode s/token is the sum of the dense part, expert compute and the drive (no overlap by default)
        assert c.points[0].step == pytest.approx(sum(c.decode_cost.parts.values()), rel=1e-12)
    steps = [r[ram].best.points[0].step for ram in (128, 256, 512)]
    assert steps[0] > steps[1] > steps[2]


def test_dense_formats_size_the_trunk(k3p):
    sizes = {d: one_box("cores=16,ram=512GB,drive=7GB/s", dense=d).best.memory[0].parts["dense weights"]
             for d in ("bf16", "int8", "int4")}
    linears = [l for lp in k3p.layers for l in (*lp.attn, *lp.mlp)]
    vectors = sum(lp.vectors * 2 + lp.vectors_fp32 * 2 for lp in k3p.layers)
    assert sizes["bf16"] == pytest.approx(sum(2 * l.params for l in linears) + vectors)
    # int8: a byte per weight + an fp32 scale per output row; int4: half a byte + a bf16 scale per 32
    assert sizes["int8"] == pytest.approx(sum(l.params + 4 * l.out_dim for l in linears) + vectors)
    assert sizes["int4"] == pytest.approx(sum(l.params * (0.5 + 2 / 32) for l in linears) + vectors)


def test_kimi_k3_one_box_example_fits_and_reports_its_rate(capsys):
    rc = main(["--model", "kimi-k3", "--box", "cores=16,ram=256GB,drive=7GB/s", "--dense", "int4", "--spill",
               "nvme", "--concurrency", "1", "--isl", "512", "--osl", "64"])
    out = capsys.readouterr().out
    assert rc == 0 and "0 layouts rejected" in out and "experts also on the drive" in out
    # the decoding line's output tok/s is concurrency / seconds per step, and the step is the TPOT at c=1
    m = re.search(r"decoding: ([0-9.e+]+) s per step of 1 sequence = ([0-9.e+]+) output tok/s", out)
    step, rate = float(m.group(1)), float(m.group(2))
    assert rate == pytest.approx(1 / step, rel=2e-3)
    row = next(line for line in out.splitlines() if line.startswith("1 "))
    cells = re.split(r"\s{2,}", row)  # #, layout, stages, GB/device, max conc, TTFT s, TPOT ms, ...
    assert float(cells[6]) == pytest.approx(step * 1e3, rel=1e-3)
    assert 1.0 < step < 20.0  # seconds per token: the drive, not host RAM, sets it


def test_report_rate_is_batch_over_step(capsys):
    assert main(["--hardware", "h200", "--devices", "16", "--layout", "pp2xtp8", "--concurrency", "1,16"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"decoding: ([0-9.e+]+) s per step of 16 sequences = ([0-9.e+]+) output tok/s", out)
    assert float(m.group(2)) == pytest.approx(16 / float(m.group(1)), rel=2e-3)
    assert "out tok/s" in out
