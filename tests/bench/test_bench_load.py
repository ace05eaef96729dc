"""bench load: fitted threads vs OpenMP defaults, quiet vs busy, each in a fresh generate process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeswap import cli
from moeswap.bench import load


def _spinners() -> set[int]:
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if load.BUSY_LOOP.encode() in cmdline.read_bytes():
                pids.add(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_load_bench_fits_threads_under_load_and_leaves_no_spinner(tiny_k3_dir, tmp_path, capsys):
    before = _spinners()
    assert cli.main(["bench", "load", str(tiny_k3_dir), "--busy", "1", "--reps", "1", "--prompt-words", "40",
                     "--max-tokens", "2", "--out-dir", str(tmp_path)]) == 0
    assert _spinners() <= before  # every background spinner was stopped
    report = json.loads(next(tmp_path.glob("load-*.json")).read_text(), parse_constant=pytest.fail)
    fitted, spin = report["rows"]
    assert fitted["settings"] == "fitted" and spin["settings"] == "OpenMP defaults"
    # under load the fitted run waits passively on fewer threads than cores; the baseline keeps OpenMP's own
    assert "passive wait" in fitted["busy"]["openmp"] and fitted["busy"]["threads"] < max(2, report["cores"])
    assert "MOESWAP_THREADS=spin" in spin["busy"]["openmp"] and "MOESWAP_THREADS=spin" in spin["quiet"]["openmp"]
    for row in report["rows"]:
        assert row["ttft_busy_over_quiet"] == pytest.approx(row["busy"]["ttft_ms"] / row["quiet"]["ttft_ms"])
        assert row["quiet"]["completion_tokens"] == row["busy"]["completion_tokens"] == 2
    assert "| fitted |" in next(tmp_path.glob("load-*.md")).read_text()
