"""Memory acceptance: with --expert-memory B on a model whose experts are ~5x B, peak RSS stays within
B + dense weights + a fixed overhead (measured in a fresh process by `moeswap bench memory`).

The overhead is what the process holds beyond Python + torch, the dense weights and the fast tier:
about 75 MB right after loading (allocator and kernel state) plus ~20 MB while generating (activations,
the expert being read, allocator slack). Ignoring the budget would add the ~150 MB of experts read."""

from __future__ import annotations

import pytest

from moeswap import tiny
from moeswap.cli import main

# Big experts, small dense weights: 3 MoE layers x 64 experts x 816 KiB = 153 MiB of MXFP4 experts.
SWAP_SIZE = dict(hidden=256, layers=4, vocab=512, heads=2, head_dim=32, kv_lora=32, q_lora=32, nope=16, rope=8,
                 experts=64, top_k=4, expert_dim=1024, latent=512, dense=256, res_block=2)
BUDGET = 32 << 20
OVERHEAD_BOUND = 150 << 20


@pytest.fixture(scope="module")
def big_expert_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny.SIZES, "swap-test", SWAP_SIZE)
        return tiny.write_tiny_model(tmp_path_factory.mktemp("models") / "big_experts", "kimi_k3", "swap-test", 0)


@pytest.mark.slow
def test_peak_rss_within_budget_plus_dense_plus_overhead(big_expert_model, tmp_path, capsys, strict_json):
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", str(big_expert_model), "--prompt-tokens", "16", "--max-tokens", "6",
                 "--expert-memory", str(BUDGET), "--prefetch", "next-layer", "--json", str(out)]) == 0
    assert "| peak resident memory" in capsys.readouterr().out
    r = strict_json(out.read_text())
    assert r["generated"] == 6 and r["expert_memory"] == BUDGET and r["prefetch"] == "next-layer"
    assert r["expert_bytes_in_checkpoint"] >= 4 * BUDGET
    assert r["expert_loads"] * r["decoded_expert_bytes"] > 3 * BUDGET  # it did swap: read far more than fits
    assert r["expert_cache_bytes_at_end"] <= BUDGET
    assert r["overhead"] == r["peak_rss"] - r["rss_before_load"] - r["dense_weight_bytes"] - r["expert_cache_bytes_at_end"]
    overhead = r["peak_rss"] - r["rss_before_load"] - r["dense_weight_bytes"] - BUDGET
    assert overhead < OVERHEAD_BOUND, f"overhead {overhead / 2**20:.0f} MiB"
