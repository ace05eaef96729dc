"""Expert parallelism over 2 CPU processes on gloo, launched here on loopback with torchrun's environment
variables: logits and greedy tokens bit-identical to one process for tiny K3 and Kimi Linear at 100 % and
25 % expert budgets, contiguous and trace-balanced placements; each rank's store loads only its experts;
a rank that dies is named by the others, which exit instead of hanging; ranks that differ are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeswap.distributed.launch import free_port, run_ranks
from moeswap.distributed.placement import balanced, contiguous
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.models.loader import LoadOptions, load_model

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).with_name("ep_worker.py")
SRC = Path(__file__).resolve().parents[2] / "src"
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(150)]  # long enough that some experts take the GEMM path
MAX_TOKENS = 6


def launch(job: dict, tmp_path: Path, world: int = 2, wait_s: float = 240) -> tuple[list[dict], list, float]:
    """Starts `world` ranks of ep_worker.py as torchrun would (env://; distributed/launch.py), waits for all
    (killing them after wait_s), returns each rank's saved result, exit codes and the seconds until the
    last one exited."""
    job = {"out": str(tmp_path / "result"), "timeout": 60, "max_tokens": MAX_TOKENS, "prompt": PROMPT, **job}
    ranks = run_ranks([sys.executable, str(WORKER), json.dumps(job)], world, wait_s,
                      {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(SRC), str(WORKER.parents[1])])})
    results = []
    for rank in range(world):
        path = Path(f"{job['out']}.{rank}")
        results.append(torch.load(path) if path.exists() else
                       {"error": f"no result; log:\n{ranks.outputs[rank][-3000:]}"})
    return results, ranks.codes, ranks.elapsed_s


def expert_bytes(store) -> int:
    return sum(store.fast.cost(k) for k in store.index.entries)


def single_process(model_dir, budget: int) -> dict:
    model, store = load_model(model_dir, LoadOptions(dtype="float32", expert_memory=budget))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT]))[0]
        tokens = generate(model, PROMPT[:12], GenerationConfig(max_tokens=MAX_TOKENS, stop_ids=())).tokens
    finally:
        store.close()
    return {"logits": logits, "tokens": tokens}


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def arch_dir(request, tiny_k3_dir, tiny_linear_dir):
    return tiny_k3_dir if request.param == "kimi_k3" else tiny_linear_dir


def config_and_budgets(model_dir):
    """The model's config and the per-rank budgets the bit-identity tests run at: every expert fits, and a
    quarter of the model's experts."""
    model, store = load_model(model_dir, LoadOptions(dtype="float32"))
    total = expert_bytes(store)
    store.close()
    return model.config, [total, total // 4]


def test_two_ranks_match_one_process_bit_for_bit(arch_dir, tmp_path):
    config, budgets = config_and_budgets(arch_dir)
    results, codes, _ = launch({"model": str(arch_dir), "budgets": budgets}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    owners = contiguous(config, 2).owners
    for b, budget in enumerate(budgets):
        ref = single_process(arch_dir, budget)
        for rank, res in enumerate(results):
            run = res["runs"][b]
            assert torch.equal(run["logits"], ref["logits"]), (rank, budget)
            assert run["tokens"] == ref["tokens"], (rank, budget)
            assert run["native_steps"] > 0  # decode steps took the C call, stopping at each MoE layer's FFN
            assert run["executor"] == "expert-parallel(resident-table)"  # the block's own executor, wrapped
            # the rank's store only ever held experts it owns
            assert run["resident"] and all(owners[l][e] == rank for l, e in run["resident"])
            ep = run["ep"]
            # what was received is exactly the other rank's pairs: pairs x width x 4 bytes
            assert ep["bytes_received"] == results[1 - rank]["runs"][b]["ep"]["bytes_sent"]
            width = config.moe.latent_dim or config.hidden_size
            assert ep["bytes_sent"] == ep["pairs_local"] * width * 4
        if budget < budgets[0]:
            assert all(r["runs"][b]["disk_reads"] > r["runs"][0]["disk_reads"] for r in results)  # it swapped


def test_balanced_placement_from_a_trace_is_exact_and_spreads_hot_experts(tiny_k3_dir, tmp_path):
    from moeswap.experts.trace import TraceRecorder, model_meta, read_trace, write_trace

    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    store.trace = TraceRecorder(model_meta(model, store, str(tiny_k3_dir)))
    generate(model, PROMPT[:40], GenerationConfig(max_tokens=8, stop_ids=()))
    path = write_trace(store.trace.trace, tmp_path / "trace.bin")
    store.close()
    trace = read_trace(path)
    placement = balanced(trace, model.config, 2)
    counts = trace.expert_counts()
    for layer, row in enumerate(placement.owners):
        if not row:
            continue
        assert sorted(row) == [0] * 8 + [1] * 8  # E/N experts each
        load = [sum(c for e, c in enumerate(counts[layer]) if row[e] == r) for r in (0, 1)]
        hot = sorted(range(16), key=lambda e: (-counts[layer][e], e))
        assert row[hot[0]] != row[hot[1]]  # the two hottest experts on different ranks
        # greedy LPT: the heavier rank carries at most the lighter one plus the largest single count
        assert abs(load[0] - load[1]) <= max(counts[layer])
    results, codes, _ = launch({"model": str(tiny_k3_dir), "budgets": [1 << 30], "trace": str(path)}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    ref = single_process(tiny_k3_dir, 1 << 30)
    for rank, res in enumerate(results):
        run = res["runs"][0]
        assert run["owners"] == [list(o) for o in placement.owners]
        assert torch.equal(run["logits"], ref["logits"]) and run["tokens"] == ref["tokens"]
        assert all(placement.owners[l][e] == rank for l, e in run["resident"])


@pytest.mark.parametrize("dies", [1, 0])
def test_a_rank_that_dies_is_named_and_the_others_exit(tiny_k3_dir, tmp_path, dies):
    results, codes, elapsed = launch({"model": str(tiny_k3_dir), "budgets": [1 << 30], "die": dies, "timeout": 30},
                                     tmp_path, wait_s=120)
    other = 1 - dies
    assert codes[dies] == 17 and codes[other] == 3
    assert elapsed < 120  # the survivor exited on its own: launch kills only at wait_s
    error = results[other]["error"]
    assert error.startswith(f"PeerLost: rank {other}: the expert exchange of layer"), error
    # rank 1 is named by its heartbeat stopping; rank 0 also hosted the rendezvous store, which goes with it
    assert f"rank {dies} has stopped" in error if dies == 1 else "rank 0 is gone" in error, error


def test_a_rank_that_hangs_is_named_after_the_timeout(tiny_k3_dir, tmp_path):
    results, codes, elapsed = launch({"model": str(tiny_k3_dir), "budgets": [1 << 30], "hang": 1, "hang_s": 25,
                                      "timeout": 6}, tmp_path, wait_s=120)
    assert codes == [3, 0]
    error = results[0]["error"]
    assert error.startswith("PeerLost: rank 0:") and "rank 1 (at exchange" in error and "stuck" in error, error


def test_ranks_with_different_checkpoints_or_versions_are_refused(tiny_k3_dir, tmp_path, copy_model):
    from moeswap.tiny import write_tiny_model

    other = write_tiny_model(tmp_path / "seed1", "kimi_k3", "tiny", 1)
    results, codes, _ = launch({"models": [str(tiny_k3_dir), str(other)], "budgets": [1 << 30]}, tmp_path)
    assert codes == [3, 3]
    for res in results:
        assert "rank 1" in res["error"] and "checkpoint" in res["error"] and "ValueError" in res["error"], res
    edited = copy_model(tiny_k3_dir)
    cfg = json.loads((edited / "config.json").read_text())
    cfg["_note"] = "edited"  # the same tensors, another config.json
    (edited / "config.json").write_text(json.dumps(cfg))
    results, codes, _ = launch({"models": [str(tiny_k3_dir), str(edited)], "budgets": [1 << 30]}, tmp_path)
    assert codes == [3, 3] and "config.json" in results[0]["error"], results[0]
    results, codes, _ = launch({"model": str(tiny_k3_dir), "budgets": [1 << 30], "version": {"1": "9.9.9"}}, tmp_path)
    assert codes == [3, 3] and "moeswap version" in results[1]["error"], results[1]


def generate_alone_and_under_torchrun(args: list[str], strict_json) -> tuple[dict, dict]:
    """`python ARGS` (a `-m moeswap generate ... --json` command line) in one process, then under torchrun on 2
    ranks: the two JSON outputs, once both exited 0 and rank 1 printed nothing."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    one = subprocess.run([sys.executable, *args], env=env, capture_output=True, timeout=120)
    assert one.returncode == 0, one.stderr.decode()
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), *args], env=env, capture_output=True, timeout=240)
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    lines = [l for l in two.stdout.decode().splitlines() if l.strip()]
    assert len(lines) == 1  # rank 1 writes nothing
    return strict_json(one.stdout.decode()), strict_json(lines[0])


def test_torchrun_generate_matches_one_process_and_only_rank_0_prints(tiny_linear_dir, strict_json):
    args = ["-m", "moeswap", "generate", str(tiny_linear_dir), "--prompt", "hello world", "--max-tokens", "6",
            "--json", "--ignore-eos"]
    single, ep = generate_alone_and_under_torchrun(args, strict_json)
    assert ep["tokens"] == single["tokens"] and ep["text"] == single["text"]
    par = ep["expert_parallel"]
    assert par["world"] == 2 and par["rank0"]["bytes_received"] > 0
    # rank 0 read only its half of the experts
    assert 0 < ep["expert_store"]["disk_reads"] < single["expert_store"]["disk_reads"]


def test_torchrun_a_user_error_on_rank_0_ends_every_rank_at_once(tiny_k3_dir, copy_model):
    model = copy_model(tiny_k3_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()  # only rank 0 reads the tokenizer: the others learn of its error from it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                          str(free_port()), "-m", "moeswap", "generate", str(model), "--prompt", "hi",
                          "--ep-timeout", "100"], env=env, capture_output=True, timeout=90)  # < the EP timeout
    errors = [l for l in run.stderr.decode().splitlines() if l.startswith("moeswap: error:")]
    assert run.returncode != 0 and len(errors) == 2 and "tokenizer" in errors[0], run.stderr.decode()[-2000:]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_lora_step_gives_one_process_loss_and_gradients(tiny_k3_dir, tmp_path, checkpointing):
    """LoRA on every target kind, routed experts included, at a 25 % budget (experts evicted and fetched
    again for backward): loss and every LoRA gradient bit-identical to one process."""
    from moeswap.train.config import TrainConfig
    from moeswap.train.targets import prepare_model
    from train.test_lora_grad import ALL_TARGETS, kda_in_range, set_adapter

    cfg = TrainConfig(model=str(tiny_k3_dir), mode="lora", target_modules=ALL_TARGETS, rank=3, alpha=6.0,
                      gradient_checkpointing=checkpointing)
    model, store = load_model(tiny_k3_dir, cfg.load)
    budget = expert_bytes(store) // 4
    store.close()
    model, store = load_model(tiny_k3_dir, cfg.load.replace(expert_memory=budget))
    try:
        kda_in_range(model)
        params = dict(prepare_model(model, cfg))
        set_adapter(model)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(3, 500, (2, 24), generator=gen)
        weights = torch.randn(2, 24, 512, generator=gen, dtype=torch.float64)
        loss = (model(tokens).double() * weights).sum()
        loss.backward()
        want = {n: p.grad for n, p in params.items()}
    finally:
        store.close()
    results, codes, _ = launch({"model": str(tiny_k3_dir), "train": True, "budget": budget,
                                "checkpointing": checkpointing}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    assert any("expert_lora" in n for n in want)
    for res in results:
        assert torch.equal(res["loss"], loss.detach())
        assert res["grads"].keys() == want.keys()
        for name, g in want.items():
            assert g is not None and torch.equal(res["grads"][name], g), name


def test_next_layer_prefetch_only_loads_owned_experts(tiny_k3_dir, tmp_path):
    """The lookahead's guesses are filtered to the rank's experts: at a 25 % budget with prefetch, the
    tokens are one process's and no rank ever holds another rank's expert."""
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    budget = expert_bytes(store) // 4
    store.close()
    results, codes, _ = launch({"model": str(tiny_k3_dir), "budgets": [budget], "prefetch": "next-layer"}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    ref = single_process(tiny_k3_dir, budget)
    owners = contiguous(model.config, 2).owners
    for rank, res in enumerate(results):
        run = res["runs"][0]
        assert torch.equal(run["logits"], ref["logits"]) and run["tokens"] == ref["tokens"]
        assert run["resident"] and all(owners[l][e] == rank for l, e in run["resident"])
