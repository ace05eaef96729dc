"""`moeswap bench gpu-kernels`: one tiny run end to end under Triton's interpreter on CPU tensors (its numbers
are meaningless there; this checks the plumbing a GPU session relies on: every variant at every token count,
agreement of the variants' outputs, the arithmetic to tokens/s and GB/s, the markdown, the strict JSON)."""

import functools

import pytest

from moeswap.bench import gpu_kernels
from moeswap.cli import main
from moeswap.ops import triton_mxfp4


@pytest.mark.skipif(not triton_mxfp4.interpreted(), reason="needs triton under TRITON_INTERPRET=1")
def test_tiny_gpu_kernel_bench_on_the_interpreter(tmp_path, monkeypatch, capsys, strict_json):
    monkeypatch.setattr(gpu_kernels, "run_bench", functools.partial(gpu_kernels.run_bench, min_seconds=0.0))
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu-kernels", "--device", "cpu", "--in-dim", "64", "--expert-dim", "32", "--tokens", "1,2",
                 "--experts", "2", "--rounds", "1", "--dtype", "float32", "--json", str(out)]) == 0
    md = capsys.readouterr().out
    r = strict_json(out.read_text())
    assert {(row["tokens"], row["variant"]) for row in r["rows"]} == {(t, v) for t in (1, 2) for v in gpu_kernels.VARIANTS}
    packed = r["expert"]["packed_bytes_per_step"]
    assert packed == 2 * 3 * 64 * 32 * 17 // 32  # two experts of three matrices, 17 bytes per 32 weights
    for row in r["rows"]:
        seconds = row["us_per_step"] * 1e-6
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / seconds)
        assert row["GBps"] == pytest.approx(row["bytes_per_step"] / seconds / 1e9)
        # fp32: the same experts by every path (bf16 resident rounds its weights: none are lost, all are exact)
        assert row["max_rel_diff_vs_torch_rows"] < 1e-5
    assert "| tokens | variant |" in md and "triton grouped" in md
    assert main(["bench", "gpu-kernels", "--device", "cuda"]) == 2 or triton_mxfp4.available()
