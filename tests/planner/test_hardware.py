"""Catalog: every number has a source, user files override, bad names and files fail clearly."""

import pytest

from moeswap.planner.errors import PlanError
from moeswap.planner.hardware import Catalog, builtin_catalog, resolve_hardware


def test_builtin_catalog_covers_hardware_md():
    cat = builtin_catalog()
    for acc in ("nvidia-h100", "nvidia-h200", "nvidia-b200", "nvidia-b300", "amd-mi325x", "ascend-910b",
                "ascend-910c", "ascend-950pr", "ascend-950dt", "thead-zhenwu-810e", "thead-zhenwu-m890"):
        assert acc in cat.entries["accelerator"]
    for e in (e for kind in cat.entries.values() for e in kind.values()):
        numbers = [k for k, v in e.fields.items() if not isinstance(v, str)]
        assert all(e.sources.get(k) for k in numbers), e.id


def test_number_without_source_is_rejected():
    text = '[accelerator.x]\nname = "x"\nmemory_gb = 10\n'
    with pytest.raises(PlanError, match=r"memory_gb.*no source"):
        Catalog().add_file("mine.toml", text)


def test_unknown_field_and_bad_value():
    with pytest.raises(PlanError, match="unknown field 'hbm'"):
        Catalog().add_file("mine.toml", '[accelerator.x]\nname = "x"\nhbm = 1\n[accelerator.x.source]\nhbm = "me"\n')
    with pytest.raises(PlanError, match="non-negative number"):
        Catalog().add_file("m.toml", '[link.l]\nname = "l"\ngbs = -1\nlatency_us = 1\n[link.l.source]\ngbs = "a"\nlatency_us = "b"\n')


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_rejected(value):
    text = f'[link.l]\nname = "l"\ngbs = {value}\nlatency_us = 1\n[link.l.source]\ngbs = "a"\nlatency_us = "b"\n'
    with pytest.raises(PlanError, match=f"field 'gbs' must be a finite non-negative number, got {value}"):
        Catalog().add_file("m.toml", text)


def test_unknown_hardware_lists_known_names():
    with pytest.raises(PlanError) as e:
        resolve_hardware("h300")
    assert "unknown hardware 'h300'" in str(e.value) and "h200" in str(e.value) and "mi350x" in str(e.value)


def test_local_before_it_is_measured_says_how_to_measure():
    # the catalog resolves names only; measuring this machine is plan()'s or the CLI's step (local.py)
    with pytest.raises(PlanError, match="'local' is not measured.*--hardware local"):
        resolve_hardware("local")


def test_accelerator_name_resolves_to_its_system():
    assert resolve_hardware("nvidia-h200").name == "h200"


def test_user_file_overrides_and_adds(tmp_path):
    f = tmp_path / "mine.toml"
    f.write_text(
        '[accelerator.nvidia-h200]\nname = "H200 derated"\nmemory_gb = 141\nmem_bw_gbs = 4000\nbf16_tflops = 900\n'
        '[accelerator.nvidia-h200.source]\nmemory_gb = "ours"\nmem_bw_gbs = "ours"\nbf16_tflops = "ours"\n'
    )
    cat = builtin_catalog()
    cat.add_file(f)
    hw = resolve_hardware("h200", cat)
    assert hw.mem_bw() == 4000e9 and hw.accel.origin == str(f)


def test_missing_bandwidth_blocks_time_estimates_only():
    hw = resolve_hardware("zhenwu-810e")
    assert hw.hbm_bytes == 96e9
    with pytest.raises(PlanError, match="no mem_bw_gbs"):
        hw.mem_bw()


def test_assumptions_are_reported():
    hw = resolve_hardware("zhenwu-m890-supernode")
    assert any("thead-zhenwu-m890.mem_bw_gbs" in a for a in hw.assumptions())
    assert not any("nvidia-h200.mem_bw_gbs" in a for a in resolve_hardware("h200").assumptions())


def test_host_is_shared_only_by_devices_in_use():
    hw = resolve_hardware("h200")
    free = 2048e9 - 2e9 - 0.05 * 2048e9  # less the engine's reserve for the OS and the runtime
    assert hw.host_bytes_per_device(1) == pytest.approx(8 * hw.host_bytes_per_device(8)) == pytest.approx(free)
