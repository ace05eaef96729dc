"""`moeswap bench kernels`: one tiny run end to end (its measurements are benchmarks, not tests; this
checks the plumbing: rows per variant, the arithmetic from time per call to GB/s and the bandwidth-share lines,
the markdown, the JSON)."""

import functools
import re

import pytest

from moeswap.bench import kernels
from moeswap.cli import main


@pytest.mark.slow
def test_tiny_kernel_bench_reports_every_variant(tmp_path, monkeypatch, capsys, strict_json):
    monkeypatch.setattr(kernels, "run_bench", functools.partial(kernels.run_bench, min_seconds=0.01))
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--in-dim", "64", "--expert-dim", "96", "--tokens", "1,2", "--experts", "3",
                 "--rounds", "1", "--fast-only", "--json", str(out)]) == 0
    md = capsys.readouterr().out
    r = strict_json(out.read_text())
    variants = {row["variant"] for row in r["rows"]}
    assert any(v.startswith("mxfp4 direct") for v in variants) and "bf16 resident" in variants
    assert {row["tokens"] for row in r["rows"]} == {1, 2}
    packed = r["expert"]["packed_bytes"]
    assert packed == 3 * 64 * 96 * 17 // 32  # three [96, 64] or [64, 96] matrices, 17 bytes per 32 weights
    for row in r["rows"]:  # bytes over the median time per call
        seconds = row["us_per_call"] * 1e-6
        assert row["GBps"] == pytest.approx(row["bytes_per_call"] / seconds / 1e9)
        assert row["packed_GBps"] == pytest.approx(packed / seconds / 1e9)
        assert row["spread"][0] <= row["us_per_call"] <= row["spread"][1]
    g = r["bandwidth_share"]
    best = next(row for row in r["rows"] if row["tokens"] == 1 and row["variant"] == g["variant"])
    assert g["packed_GBps"] == best["packed_GBps"]
    assert g["fraction_of_read_bandwidth"] == pytest.approx(g["packed_GBps"] / r["bandwidth"]["read_GBps"])
    assert "| tokens |" in md and (f"{g['variant']} at 1 token reads packed bytes at {g['packed_GBps']:.1f} GB/s = "
                                   f"{g['fraction_of_read_bandwidth']:.0%} of the measured read bandwidth") in md
    # measurements and ratios only: the project's goals are docs/benchmarks.md's, not the report's
    assert not re.search(r"\b(goal|target|met)\b", md, re.IGNORECASE) and "met" not in g
    # block FP8 and INT4: their direct kernels over their own stored bytes, each with its line
    assert {"fp8 direct (cpu_c)", "int4 direct (cpu_c)"} <= variants
    assert r["expert"]["stored_bytes"] == {"mxfp4": packed, "fp8": 3 * 64 * 96 + 3 * 4,  # one partial scale block each
                                           "int4": 3 * 64 * 96 // 2 + 3 * 2 * 64 * 96 // 32}
    for kind, fg in r["format_bandwidth_shares"].items():
        row = next(row for row in r["rows"] if row["tokens"] == 1 and row["variant"] == f"{kind} direct (cpu_c)")
        assert row["bytes_per_call"] == fg["stored_bytes"] == r["expert"]["stored_bytes"][kind]
        assert fg["fraction_of_read_bandwidth"] == pytest.approx(row["GBps"] / r["bandwidth"]["read_GBps"])
        assert f"\n{kind} direct (cpu_c) at 1 token reads its" in md


@pytest.mark.parametrize("bench", ["kernels", "gpu-kernels"])
@pytest.mark.parametrize("flags, message", [
    (["--tokens", "0"], "--tokens must list positive integers, got '0'"),
    (["--tokens", ","], "--tokens must list positive integers, got ','"),
    (["--in-dim", "33"], "--in-dim and --expert-dim must be multiples of 32, got 33 and 3072"),
])
def test_bad_shapes_are_refused_in_one_line_with_exit_2(bench, flags, message, capsys):
    assert main(["bench", bench, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
