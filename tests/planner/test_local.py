"""`--hardware local`: the saved file loads as a catalog and plans (measured numbers are not asserted)."""

import json

from moeswap.planner import PlanRequest, Serve, plan
from moeswap.planner.models import parse_model_dict, preset_path
from moeswap.planner.hardware import builtin_catalog, resolve_hardware
from moeswap.planner.local import load_or_measure, measure, write_toml


def test_measure_writes_a_loadable_catalog(tmp_path):
    data = measure("cpu", disk_dir=tmp_path, quick=True)
    path = tmp_path / "hw.toml"
    write_toml(data, path)
    cat = builtin_catalog()
    cat.add_file(path)
    hw = resolve_hardware("local", cat, local_path=path)
    assert hw.accel.mem_bw_gbs > 0 and hw.engine.kernel_us > 0 and hw.system.node_devices == 1
    assert all("[measured]" in s for s in hw.accel.sources.values())
    raw = json.loads(preset_path("kimi-linear-48b").read_text())
    raw["num_experts"] = 16  # a Kimi Linear small enough for a CI machine's RAM
    r = plan(PlanRequest(model=parse_model_dict(raw), hardware="local", devices=1, local_path=str(path),
                         serve=Serve(256, 32, (1,))), cat)
    assert r.best.points[0].tpot > 0
    # the saved file is reused, not measured again
    assert load_or_measure(builtin_catalog(), path)[0].origin == str(path)
