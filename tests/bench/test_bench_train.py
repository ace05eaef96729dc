"""`moeswap bench train`'s plumbing on tiny models (no timing asserted): moeswap and PEFT train the same model on
the same rows (their first-step losses, the base model's loss on the first batch, agree), count the same
tokens and trainable parameters, and the K3 run at a 25 % expert budget swaps experts in forward and backward."""

from __future__ import annotations

import pytest

from moeswap import cli


@pytest.mark.slow
def test_bench_train_plumbing(tiny_linear_dir, tiny_k3_dir, tmp_path, capsys, strict_json):
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    code = cli.main(["bench", "train", str(tiny_linear_dir), "--k3", str(tiny_k3_dir), "--steps", "2",
                     "--micro-batch", "1", "--seq-len", "16", "--rank", "4", "--lr", "1e-2", "--threads", "1",
                     "--budgets", "25", "--rounds", "2", "--out-dir", "", "--json", str(tmp_path / "r.json"),
                     "--markdown", str(tmp_path / "r.md")])
    out = capsys.readouterr().out
    assert code == 0
    report = strict_json((tmp_path / "r.json").read_text())
    ours, theirs = report["linear"]["moeswap"], report["linear"]["peft"]
    assert ours["tokens"] == theirs["tokens"] == 2 * 16 and ours["steps"] == theirs["steps"] == 2
    assert ours["trainable_parameters"] == theirs["trainable_parameters"] > 0
    assert ours["first_loss"] == pytest.approx(theirs["first_loss"], abs=1e-4)  # same model, same first batch
    assert report["linear"]["speedup"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    # two rounds, alternating sides: the report stands on the lower of the two ratios (the median's lower middle)
    rounds = report["linear"]["rounds"]
    assert len(rounds) == 2 and report["linear"]["speedup"] == min(r["speedup"] for r in rounds)
    assert all(r["moeswap"]["first_loss"] == ours["first_loss"] for r in rounds)  # the same run each round
    (quarter,) = report["k3_runs"]  # (equal losses at 25 % and 100 %: tests/train/test_lora_train.py)
    assert quarter["budget_percent"] == 25 and quarter["expert_memory"] == quarter["expert_bytes"] // 4
    assert quarter["expert_evictions"] > 0 and quarter["graph"]["refetched"] > 0
    md = (tmp_path / "r.md").read_text()
    assert md.strip() == out.split("wrote ")[0].strip()
    assert "moeswap / PEFT: " in md and "| 25 % (" in md and "the median of 2 rounds" in md


@pytest.mark.parametrize("flag", ["--rounds", "--steps", "--threads"])
def test_bench_train_refuses_counts_below_one_in_one_line(tiny_linear_dir, capsys, flag):
    assert cli.main(["bench", "train", str(tiny_linear_dir), flag, "0", "--out-dir", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} must be >= 1" in err
