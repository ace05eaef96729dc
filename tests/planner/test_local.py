"""`--hardware local`: the saved file loads as a catalog and plans (measured numbers are not asserted)."""

import json

import pytest

from moeswap.ops import cpu_kernels
from moeswap.planner import PlanRequest, Serve, plan
from moeswap.planner.hardware import builtin_catalog, resolve_hardware
from moeswap.planner.local import load_or_measure, measure, write_toml
from moeswap.planner.models import parse_model_dict, preset_path


@pytest.mark.slow
def test_measure_writes_a_loadable_catalog(tmp_path):
    data = measure("cpu", disk_dir=tmp_path, quick=True)
    path = tmp_path / "hw.toml"
    write_toml(data, path)
    cat = builtin_catalog()
    cat.add_file(path)
    hw = resolve_hardware("local", cat)
    assert hw.accel.mem_bw_gbs > 0 and hw.engine.kernel_us > 0 and hw.system.node_devices == 1
    assert all("[measured]" in s for s in hw.accel.sources.values())
    # on a CPU the engine profile is moeswap's own: its kernels' rates, per-op time and op counts
    measured = ("mem_efficiency", "kernel_us", "kernels_kda", "kernels_mla", "kernels_moe", "kernels_step", "expert_us")
    if cpu_kernels.kernel() is not None:  # the grouped MXFP4 call is timed only where it builds
        measured += ("expert_row_ns", "expert_mem_efficiency")
    assert all(hw.engine.get(k) is not None and "[measured]" in hw.engine.sources[k] for k in measured)
    assert hw.engine.kernels_moe > 0 and hw.engine.kernels_kda > 0 and hw.engine.kernels_step > 0
    raw = json.loads(preset_path("kimi-linear-48b").read_text())
    raw["num_experts"] = 16  # a Kimi Linear small enough for a CI machine's RAM
    r = plan(PlanRequest(model=parse_model_dict(raw), hardware="local", devices=1, local_path=str(path),
                         serve=Serve(256, 32, (1,))), cat)
    assert r.best.points[0].tpot > 0
    # the saved file is reused, not measured again
    before = path.read_text()
    assert load_or_measure(builtin_catalog(), path)[0].origin == str(path)
    assert path.read_text() == before


def test_a_measurement_of_another_build_is_measured_again(tmp_path, monkeypatch, capsys):
    from moeswap.planner import local

    path = tmp_path / "hw.toml"
    calls = []
    monkeypatch.setattr(local, "measure", lambda *a, **k: calls.append(1) or {})
    local.write_toml({}, path)
    assert local.saved_fingerprint(path) == local.engine_fingerprint()
    local.load_or_measure(builtin_catalog(), path)
    assert calls == []  # same build: reused
    path.write_text(path.read_text().replace(local.engine_fingerprint(), "0.0.1+000000000000"))
    local.load_or_measure(builtin_catalog(), path)
    assert calls == [1] and "another moeswap build" in capsys.readouterr().err
    assert local.saved_fingerprint(path) == local.engine_fingerprint()
    old = local.WRITTEN_LINE + "\n\n[system.x]\n"  # written before fingerprints: measured again too
    path.write_text(old)
    assert local.saved_fingerprint(path) == ""
    local.load_or_measure(builtin_catalog(), path)
    assert calls == [1, 1]
    hand = tmp_path / "mine.toml"  # a file moeswap did not write is never measured over
    hand.write_text("# my machine\n")
    assert local.saved_fingerprint(hand) is None
    local.load_or_measure(builtin_catalog(), hand)
    assert calls == [1, 1] and hand.read_text() == "# my machine\n"
