"""Data-parallel attention with token dispatch (distributed/dispatch.py) over 2 CPU processes on gloo,
launched here on loopback: each rank runs its own prompts, and every prompt's logits and greedy tokens are
bit-identical to one process running that prompt alone, for tiny K3 and Kimi Linear at 100 % and 25 %
expert budgets, with uneven prompt counts and lengths (a rank idles while the other still has tokens, a
rank that never has any); the bytes each rank receives are the pairs the other sent; a rank that dies is
named by the other, which exits; `torchrun generate` with several prompts prints one process's outputs in
order."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# arch_dir is a fixture: imported, pytest finds it here too
from distributed.test_expert_parallel import (  # noqa: F401
    SRC,
    arch_dir,
    config_and_budgets,
    generate_alone_and_under_torchrun,
    launch,
)
from moeswap.distributed.placement import contiguous
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.models.loader import LoadOptions, load_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# prompt i runs on rank i % 2: rank 0 gets a 150-token prompt (some experts on the GEMM path) and a short
# one, rank 1 one of 40 tokens and fewer decode steps, so it finishes first and answers rank 0 idle
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(150)], [(11 * i + 1) % 500 + 5 for i in range(40)],
           [(5 * i + 2) % 500 + 5 for i in range(9)]]
MAX_TOKENS = [6, 3, 8]


def one_process(model_dir, budget: int, prompts, max_tokens) -> list[dict]:
    """Each prompt alone in one process: logits of the whole prompt, greedy tokens."""
    model, store = load_model(model_dir, LoadOptions(dtype="float32", expert_memory=budget))
    out = []
    try:
        for prompt, n in zip(prompts, max_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([prompt]))[0]
            tokens = generate(model, prompt, GenerationConfig(max_tokens=n, stop_ids=())).tokens
            out.append({"logits": logits, "tokens": tokens})
    finally:
        store.close()
    return out


def test_each_rank_its_own_prompts_matches_one_process_bit_for_bit(arch_dir, tmp_path):
    config, budgets = config_and_budgets(arch_dir)
    results, codes, _ = launch({"model": str(arch_dir), "budgets": budgets, "data_parallel": True,
                                "prompts": PROMPTS, "max_tokens": MAX_TOKENS}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    owners = contiguous(config, 2).owners
    K, width = config.moe.top_k, config.moe.latent_dim or config.hidden_size
    for b, budget in enumerate(budgets):
        ref = one_process(arch_dir, budget, PROMPTS, MAX_TOKENS)
        for rank, res in enumerate(results):
            run = res["runs"][b]
            for i, (got, want) in enumerate(zip(run["results"], ref)):
                assert got["rank"] == i % 2  # prompt i ran on rank i % 2, and every rank has every result
                assert torch.equal(got["logits"], want["logits"]), (rank, budget, i)
                assert got["tokens"] == want["tokens"], (rank, budget, i)
                assert got["native_steps"] > 0  # decode steps took the C call, leaving it at each MoE layer
                assert got["executor"] == "token-dispatch(resident-table)"
            assert run["resident"] and all(owners[l][e] == rank for l, e in run["resident"])
        d0, d1 = results[0]["runs"][b]["dispatch"], results[1]["runs"][b]["dispatch"]
        # what a rank receives is what the other sent, both ways; the owners computed every pair once
        assert d0["dispatch_bytes_received"] == d1["dispatch_bytes_sent"] > 0
        assert d1["dispatch_bytes_received"] == d0["dispatch_bytes_sent"] > 0
        assert d0["combine_bytes_received"] == d0["dispatch_bytes_sent"]
        both = d0["tokens_through_moe_layers"] + d1["tokens_through_moe_layers"]
        assert d0["tokens_all_ranks"] == d1["tokens_all_ranks"] == both
        assert d0["pairs_computed"] + d1["pairs_computed"] == K * d0["tokens_all_ranks"]
        assert d0["exchanges"] == d1["exchanges"]  # rank 1 took part after its own prompt was done
        assert d0["tokens_through_moe_layers"] > d1["tokens_through_moe_layers"]
        assert d0["split_computes"] + d1["split_computes"] > 0  # prefill: pairs computed source by source
        assert d0["dispatch_bytes_sent"] % (width * 4) == 0  # whole fp32 rows of the expert width
        if budget < budgets[0]:
            assert all(r["runs"][b]["disk_reads"] > r["runs"][0]["disk_reads"] for r in results)  # it swapped


def test_a_rank_without_prompts_serves_the_others_experts(tiny_k3_dir, tmp_path):
    prompts, max_tokens = [PROMPTS[2]], [5]
    results, codes, _ = launch({"model": str(tiny_k3_dir), "budgets": [1 << 30], "data_parallel": True,
                                "prompts": prompts, "max_tokens": max_tokens}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    ref = one_process(tiny_k3_dir, 1 << 30, prompts, max_tokens)
    for res in results:
        got = res["runs"][0]["results"][0]
        assert torch.equal(got["logits"], ref[0]["logits"]) and got["tokens"] == ref[0]["tokens"]
    idle = results[1]["runs"][0]["dispatch"]
    assert idle["tokens_through_moe_layers"] == 0 and idle["pairs_computed"] > 0 and idle["dispatch_bytes_received"] > 0


def test_torchrun_generate_with_several_prompts_prints_one_process_outputs_in_order(tiny_linear_dir, strict_json):
    args = ["-m", "moeswap", "generate", str(tiny_linear_dir), "--prompt", "hello world", "--prompt",
            "the quick brown fox jumps over", "--prompt", "a", "--max-tokens", "5", "--json", "--ignore-eos"]
    single, ep = generate_alone_and_under_torchrun(args, strict_json)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    alone = subprocess.run([sys.executable, *args[:4], "--prompt", "a", *args[-4:]], env=env, capture_output=True,
                           timeout=120)
    assert alone.returncode == 0, alone.stderr.decode()
    assert strict_json(alone.stdout.decode())["tokens"] == single["outputs"][2]["tokens"]  # each prompt on its own
    assert [o["tokens"] for o in ep["outputs"]] == [o["tokens"] for o in single["outputs"]]
    assert [o["text"] for o in ep["outputs"]] == [o["text"] for o in single["outputs"]]
    assert [o["rank"] for o in ep["outputs"]] == [0, 1, 0] and [o["prompt_index"] for o in ep["outputs"]] == [0, 1, 2]
    par = ep["expert_parallel"]
    assert par["world"] == 2 and par["mode"] == "data-parallel" and par["rank0"]["dispatch_bytes_received"] > 0


def test_a_rank_that_dies_is_named_and_the_other_exits(tiny_k3_dir, tmp_path):
    results, codes, elapsed = launch({"model": str(tiny_k3_dir), "budgets": [1 << 30], "data_parallel": True,
                                      "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "die": 1, "timeout": 30},
                                     tmp_path, wait_s=120)
    assert codes == [3, 17]
    assert elapsed < 120  # rank 0 exited on its own: launch kills only at wait_s
    error = results[0]["error"]
    assert error.startswith("PeerLost: rank 0: the expert exchange of layer") and "rank 1 has stopped" in error, error


def test_several_prompts_with_lora_is_a_one_line_error(tiny_k3_dir, capsys):
    from moeswap.cli import main

    assert main(["generate", str(tiny_k3_dir), "--prompt", "a", "--prompt", "b", "--lora", "x"]) == 2
    assert capsys.readouterr().err.strip() == "moeswap: error: --lora takes a single --prompt"
