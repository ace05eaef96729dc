"""`moeswap bench kernels`: one tiny run end to end (its measurements are benchmarks, not tests; this
checks the plumbing: rows per variant, the goal line, the markdown)."""

from moeswap.bench import kernels


def test_tiny_kernel_bench_reports_every_variant():
    r = kernels.run_bench(in_dim=64, expert_dim=96, tokens=(1, 2), n_experts=3, rounds=1, min_seconds=0.01, slow_variants=False)
    variants = {row["variant"] for row in r["rows"]}
    assert any(v.startswith("mxfp4 direct") for v in variants) and "bf16 resident" in variants
    assert {row["tokens"] for row in r["rows"]} == {1, 2}
    assert all(row["GBps"] > 0 for row in r["rows"])
    md = kernels.format_report(r)
    assert "goal:" in md and "| tokens |" in md
