"""Every bench that writes files writes them, by default, to one place (bench.RESULTS_DIR, relative to the
working directory); `bench cache` used to write into the working directory itself."""

from __future__ import annotations

import argparse
import json

from moeswap import cli
from moeswap.bench import RESULTS_DIR
from moeswap.experts.trace import TraceRecorder, write_trace

# benches that print and write only what --json FILE names
PRINT_ONLY = {"memory", "kernels", "gpu-kernels"}


def bench_parsers() -> dict[str, argparse.ArgumentParser]:
    def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    return choices(choices(cli.build_parser())["bench"])


def test_every_bench_defaults_to_one_results_directory():
    parsers = bench_parsers()
    assert set(parsers) == set(cli.BENCHES)
    writers = {name for name, p in parsers.items() if any(a.dest == "out_dir" for a in p._actions)}
    assert writers == set(cli.BENCHES) - PRINT_ONLY
    assert {name: parsers[name].get_default("out_dir") for name in writers} == dict.fromkeys(writers, RESULTS_DIR)
    for name in PRINT_ONLY:  # nothing written unless asked
        assert parsers[name].get_default("json") is None


def test_bench_cache_writes_into_the_results_directory_by_default(tmp_path, monkeypatch, capsys):
    meta = {"num_layers": 3, "num_experts": 8, "moe_layers": [1, 2], "top_k": 2, "expert_stored_bytes": 100}
    rec = TraceRecorder(meta)
    for step in range(4):
        for layer in meta["moe_layers"]:
            rec.record(layer, [(step + layer) % 8, (step + layer + 3) % 8])
    trace = write_trace(rec.trace, tmp_path / "t.bin")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "cache", "--trace", str(trace), "--budgets", "25,100", "--policies", "lru,belady"]) == 0
    written = sorted(p.name for p in (tmp_path / RESULTS_DIR).iterdir())
    assert written[:2] == ["cache-hit-rate.json", "cache-hit-rate.md"]
    assert not list(tmp_path.glob("cache-hit-rate*"))
    assert json.loads((tmp_path / RESULTS_DIR / "cache-hit-rate.json").read_text())["accesses"] == 16
    assert f"wrote {RESULTS_DIR}/cache-hit-rate.md" in capsys.readouterr().out
