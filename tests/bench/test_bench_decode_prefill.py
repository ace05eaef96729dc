"""`moeswap bench decode|prefill`: the report's shape, the roofline inputs, peers skipped with a reason.
(The measurements themselves are benchmarks, not tests: what is checked is their plumbing, that each
rate is the reported count over the reported time, and that moeswap's tokens are the greedy ones.)"""

import pytest

from moeswap.bench import decode, prefill
from moeswap.bench import sidebyside as sbs
from moeswap.cli import main
from moeswap.models.loader import LoadOptions, load_model


def test_decode_bytes_counts_dense_and_active_experts(tiny_k3_dir):
    b = sbs.decode_bytes(str(tiny_k3_dir))
    # tiny K3: 5 MoE layers, top-4 of 16 experts; experts are MXFP4 (17 bytes per 32 weights)
    per_expert = 3 * 32 * 64 * 17 / 32
    assert b["moe_layers"] == 5 and b["top_k"] == 4
    assert b["active_expert_bytes"] == pytest.approx(4 * 5 * per_expert)
    assert b["per_token_bytes"] == b["dense_bytes"] + b["active_expert_bytes"]
    assert b["num_experts"] == 16 and b["expert_bytes"] == pytest.approx(per_expert)
    assert b["active_params"] == b["dense_params"] + 4 * 5 * 3 * 32 * 64  # top-4 experts of 3 x [32, 64] weights


def test_batch_roofline_is_the_slower_of_memory_and_compute():
    by = {"num_experts": 16, "top_k": 4, "dense_bytes": 1e6, "moe_layers": 2, "expert_bytes": 1e5, "active_params": 1e6}
    one = sbs.batch_roofline(by, read_GBps=1.0, gflops=1e3, batch=1)
    assert one["bound"] == "memory" and one["step_bytes"] == pytest.approx(1e6 + 2 * 4 * 1e5)
    many = sbs.batch_roofline(by, read_GBps=1.0, gflops=1e3, batch=64)
    assert many["step_bytes"] == pytest.approx(1e6 + 2 * 16 * (1 - 0.75**64) * 1e5)  # nearly every expert
    slow = sbs.batch_roofline(by, read_GBps=1.0, gflops=0.01, batch=64)  # 2 x 1e6 x 64 FLOPs at 10 MFLOP/s
    assert slow["bound"] == "compute" and slow["tokens_per_s"] == pytest.approx(64 / 12.8)


@pytest.mark.slow
def test_decode_and_prefill_reports(tiny_k3_dir, tmp_path, greedy_oracle, strict_json):
    setup = sbs.Setup(str(tiny_k3_dir), threads=1, peers=("transformers", "nonesuch"), reps=1)
    rep = decode.measure(setup, [1, 2], prompt_tokens=8, tokens=3)
    assert rep["skipped"]["transformers"].startswith("transformers has no kimi_k3 model")
    assert "unknown peer" in rep["skipped"]["nonesuch"] and list(rep["peers"]) == ["moeswap"]
    assert [r["batch"] for r in rep["rows"]] == [1, 2]
    for r in rep["rows"]:  # the rate is the engine's own count over its own time: batch x 2 steps / seconds
        m, e = r["results"]["moeswap"], r["results"]["moeswap"]["engine"]
        assert e["decode_steps"] == 2 and e["decode_tokens"] == 2 * r["batch"]
        assert m["tokens_per_s"] == pytest.approx(e["decode_tokens"] / e["decode_s"])
        assert m["tokens_per_s"] == pytest.approx(e["decode_tokens_per_s"])
        assert m["ms_per_step"] == pytest.approx(1e3 * e["decode_s"] / 2)
    one, two = (r["results"]["moeswap"]["tokens_per_s"] for r in rep["rows"])
    assert rep["rows"][1]["moeswap_scaling_vs_batch1"] == pytest.approx(two / one)
    model, _ = load_model(tiny_k3_dir, LoadOptions())
    prompt = sbs.random_prompts(1, 8, model.config.vocab_size, seed=1)[0]  # batch 1's prompt
    assert rep["rows"][0]["moeswap_tokens_first_seq"] == greedy_oracle(model, prompt, 3)
    bw = rep["bandwidth"]
    assert bw["read_GBps"] > 0 and rep["gemm_gflops"] > 0  # measured: the inputs of the ceilings below
    assert rep["roofline_tokens_per_s"] == pytest.approx(bw["read_GBps"] * 1e9 / rep["bytes"]["per_token_bytes"])
    assert rep["rooflines"] == [sbs.batch_roofline(rep["bytes"], bw["read_GBps"], rep["gemm_gflops"], b) for b in (1, 2)]
    md = decode.format_markdown(rep)
    assert "SKIPPED" in md and "roofline" in md and md.count("\n| ") == 3 and "batch 2 " in md
    steps = sum(r["results"]["moeswap"]["engine"]["decode_steps"] for r in rep["rows"])
    assert f"native C call (engine/native_step.py): {steps} of {steps} " in md  # every decode step took it
    (path,) = sbs.write_report("decode", rep, md, None, str(tmp_path / "decode.json"), None)
    assert strict_json(open(path).read())["rows"][0]["batch"] == 1
    rep = prefill.measure(setup, [5, 9])
    assert [r["prompt_tokens"] for r in rep["rows"]] == [5, 9]
    for r in rep["rows"]:  # prompt tokens over the time to the first token
        m = r["results"]["moeswap"]
        assert m["tokens_per_s"] == pytest.approx(r["prompt_tokens"] / (m["ttft_ms"] / 1e3))
    assert prefill.format_markdown(rep).count("\n| ") == 3


@pytest.mark.slow
def test_the_reference_step_runs_beside_the_native_one(tiny_k3_dir):
    """--peers moeswap-reference: moeswap through the model's modules as a peer, the same tokens; and
    --reference-step takes moeswap itself off the native step."""
    setup = sbs.Setup(str(tiny_k3_dir), threads=1, peers=("moeswap-reference",), reps=1)
    rep = decode.measure(setup, [1], prompt_tokens=8, tokens=3)
    row = rep["rows"][0]["results"]
    assert row["moeswap-reference"]["greedy_agree_16"] == [3]
    assert row["moeswap-reference"]["moeswap_ratio"] == pytest.approx(
        row["moeswap"]["tokens_per_s"] / row["moeswap-reference"]["tokens_per_s"])
    md = decode.format_markdown(rep)
    assert "moeswap / moeswap-reference" in md and "native C call (engine/native_step.py): 2 of 2 " in md
    off = decode.measure(sbs.Setup(str(tiny_k3_dir), threads=1, peers=(), reps=1, reference_step=True), [1], 8, 3)
    assert off["settings"]["reference_step"] is True
    assert "native C call (engine/native_step.py): 0 of 2 " in decode.format_markdown(off)


@pytest.mark.slow
def test_cli_writes_json_and_markdown(tiny_k3_dir, tmp_path, capsys, strict_json):
    out = tmp_path / "r.json"
    code = main(["bench", "prefill", str(tiny_k3_dir), "--peers", "", "--reps", "1", "--threads", "1",
                 "--prompt-tokens", "4", "--out-dir", "", "--json", str(out)])
    assert code == 0 and strict_json(out.read_text())["bench"] == "prefill"
    assert "prefill, batch 1" in capsys.readouterr().out
    assert main(["bench", "decode", str(tiny_k3_dir), "--batch", "0"]) == 2
