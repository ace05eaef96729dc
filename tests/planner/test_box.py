"""--box: parsing one-line and TOML machine descriptions (good and bad input), and the catalog entries a
box becomes: the user's numbers marked [user], the ones filled in marked [assumption]."""

import pytest

from moeswap.planner.box import BF16_TFLOPS_PER_CORE, MEM_BW_PER_CORE_GBS, Box, add_box, parse_box
from moeswap.planner.cli import main
from moeswap.planner.errors import PlanError
from moeswap.planner.hardware import builtin_catalog, resolve_hardware


def test_one_line_box_parses_units():
    b = parse_box("cores=16, ram=256GB ,mem_bw=80GB/s,drive=7GB/s,disk=2TB,gpu=h100")
    assert b == Box(cores=16, ram_gb=256.0, drive_gbs=7.0, mem_bw_gbs=80.0, disk_tb=2.0, gpu="h100")
    b = parse_box("cores=8,ram=64GiB,drive=3500MB/s")
    assert b.ram_gb == pytest.approx(64 * 2**30 / 1e9) and b.drive_gbs == pytest.approx(3.5)
    assert b.mem_bw == 8 * MEM_BW_PER_CORE_GBS and b.cpu_tflops == 8 * BF16_TFLOPS_PER_CORE  # filled in


def test_toml_box_matches_the_one_line_form(tmp_path):
    f = tmp_path / "box.toml"
    f.write_text('cores = 16\nram = "256GB"\nmem_bw = "80GB/s"\ndrive = "7GB/s"\n')
    one_line = parse_box("cores=16,ram=256GB,mem_bw=80GB/s,drive=7GB/s")
    assert parse_box(str(f)) == Box(**{**one_line.__dict__, "origin": f"--box {f}"})


@pytest.mark.parametrize("spec, words", [
    ("cores=16,ram=256GB", "missing drive"),
    ("cores=16,ram=256,drive=7GB/s", "ram=256: expected a size with its unit"),
    ("cores=16,ram=256GB,drive=7GB", "drive=7GB: expected a rate with its unit"),
    ("cores=16,ram=256GB/s,drive=7GB/s", "expected a size"),
    ("cores=0,ram=256GB,drive=7GB/s", "cores=0: expected a whole number"),
    ("cores=16,ram=0GB,drive=7GB/s", "expected a positive size"),
    ("cores=16,rma=256GB,drive=7GB/s", "unknown key 'rma'"),
    ("cores=16,ram=256GB,ram=512GB,drive=7GB/s", "ram is given twice"),
    ("cores=16,ram,drive=7GB/s", "'ram' is not key=value"),
])
def test_bad_boxes_say_what_is_wrong(spec, words):
    with pytest.raises(PlanError, match=words):
        parse_box(spec)


def test_bad_toml_box(tmp_path):
    f = tmp_path / "box.toml"
    f.write_text("cores = 16\nram = 256\ndrive = \"7GB/s\"\n")
    with pytest.raises(PlanError, match="ram=256: expected a size"):
        parse_box(str(f))
    f.write_text("cores = [16]\n")
    with pytest.raises(PlanError, match="cores must be a number or a string"):
        parse_box(str(f))
    f.write_text("cores = \n")
    with pytest.raises(PlanError, match="not valid TOML"):
        parse_box(str(f))


@pytest.mark.parametrize("argv, words", [
    (["--box", "cores=16,ram=256GB"], "missing drive"),
    (["--box", "cores=16,ram=1TB,drive=7GB/s,gpu=h900"], "gpu=h900: unknown"),
    (["--box", "cores=16,ram=1TB,drive=7GB/s", "--hardware", "h200"], "--hardware or --box, not both"),
    (["--box", "cores=16,ram=1TB,drive=7GB/s", "--dense", "fp8"], "--dense fp8: moeswap keeps fp8 dense weights"),
])
def test_cli_errors_are_one_line_exit_2(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_cpu_box_is_a_catalog_system_with_user_sources():
    cat = builtin_catalog()
    name = add_box(cat, parse_box("cores=16,ram=256GB,drive=7GB/s"))
    hw = resolve_hardware(name, cat)
    assert hw.host is None and hw.hbm_bytes == 256e9 and hw.storage.read_gbs == 7.0
    assert hw.accel.sources["memory_gb"].startswith("[user] --box")
    assert hw.storage_bw_per_device(1) == 7e9 * hw.engine.storage_efficiency  # a rated drive, as the catalog's
    assumed = " ".join(hw.assumptions())  # mem_bw, FLOP/s and disk were filled in: the plan lists them
    assert "accelerator.box.mem_bw_gbs" in assumed and "bf16_tflops" in assumed and "storage.box.capacity_tb" in assumed
    assert hw.engine.gemm_half_m == 0 and hw.engine.kernels_moe == cat.get("engine", "moeswap-cpu").kernels_moe


def test_gpu_box_puts_the_ram_beside_the_accelerator():
    cat = builtin_catalog()
    hw = resolve_hardware(add_box(cat, parse_box("cores=32,ram=512GB,mem_bw=300GB/s,drive=7GB/s,gpu=h100")), cat)
    assert hw.accel.id == "nvidia-h100" and hw.host.memory_gb == 512 and hw.host.mem_bw_gbs == 300
    assert hw.host_link.id == "pcie5-x16" and hw.engine.kernel_us == cat.get("engine", "default").kernel_us
    assert not any("mem_bw" in a for a in hw.assumptions())  # given, not assumed
