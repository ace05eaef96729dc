"""`moeswap bench ep` end to end on a tiny K3 (2 ranks on loopback): the N-rank run gives the 1-process
tokens, each rank read only its half of the experts, and the bytes exchanged per token per layer equal
the planner's figure (replicated attention) averaged over ranks: (N-1)/N x top-k x width x itemsize; in the
data-parallel mode (rank r its own sequence) the same tokens as one process generating the sequences one
after another, and dispatch bytes within 10 % of the planner's dispatch term, (N-1)/N^2 x top-k x width x
itemsize per token of the whole batch."""

from __future__ import annotations

import pytest

from moeswap.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_bench_ep_reports_the_planners_bytes_and_the_same_tokens(tiny_k3_dir, tmp_path, capsys, strict_json):
    from moeswap.config import load_config

    assert main(["bench", "ep", str(tiny_k3_dir), "--nproc", "2", "--max-tokens", "4", "--prompt-tokens", "6",
                 "--out-dir", str(tmp_path)]) == 0
    assert "Same tokens as 1 process." in capsys.readouterr().out
    (path,) = tmp_path.glob("ep-*.json")
    r = strict_json(path.read_text())
    cfg = load_config(tiny_k3_dir)
    b = r["bytes_per_token_per_layer"]
    assert b["planner_replicated"] == cfg.moe.top_k * (cfg.moe.latent_dim or cfg.hidden_size) * 4 / 2
    assert abs(b["ratio_measured_to_planner"] - 1) < 0.10  # the bar; in aggregate it is exact
    assert b["measured_mean_over_ranks"] == b["planner_replicated"]
    assert r["same_tokens"] and len(r["runs"]["2"]) == 2
    single = r["disk_reads"]["1"]
    assert sum(r["disk_reads"]["per_rank"]) == single and all(0 < d < single for d in r["disk_reads"]["per_rank"])
    assert all(0 <= s <= 1 for s in r["time_s"]["collective_share_per_rank"])
    d = r["data_parallel"]
    assert d["same_tokens"] and d["sequences"] == 2 and len(d["runs"]["1"][0]["sequences"]) == 2
    b = d["bytes_per_token_per_layer"]
    assert b["planner_data_parallel"] == cfg.moe.top_k * (cfg.moe.latent_dim or cfg.hidden_size) * 4 / 4
    assert abs(b["ratio_measured_to_planner"] - 1) < 0.10
    assert b["combine_mean_over_ranks"] == pytest.approx(b["measured_mean_over_ranks"], rel=1e-12)
    assert all(0 < x < d["disk_reads"]["1"] for x in d["disk_reads"]["per_rank"])  # each rank its own experts


def test_bench_ep_bad_flags_are_one_line_errors(tiny_k3_dir, tmp_path, capsys):
    assert main(["bench", "ep", str(tiny_k3_dir), "--nproc", "1", "--out-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "moeswap: error: --nproc must be >= 2, got 1"
