"""bench load: fitted threads vs OpenMP defaults, quiet vs busy, each in a fresh generate process."""

from __future__ import annotations

import json
import subprocess

import pytest

from moeswap import cli
from moeswap.bench import load


@pytest.mark.slow
def test_load_bench_fits_threads_under_load_and_leaves_no_spinner(tiny_k3_dir, tmp_path, capsys, monkeypatch):
    started = []  # every process the bench starts: the spinners (generate runs through subprocess.run)
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert cli.main(["bench", "load", str(tiny_k3_dir), "--busy", "1", "--reps", "1", "--prompt-words", "40",
                     "--max-tokens", "2", "--out-dir", str(tmp_path)]) == 0
    spinners = [p for p in started if load.BUSY_LOOP in p.args]
    assert len(spinners) == 2 and all(p.poll() is not None for p in spinners)  # one per busy run, all stopped
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
