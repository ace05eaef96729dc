"""The swap core under a real model: the same greedy tokens at a 10 % fast tier for every policy with and
without prefetch, decoded copies and a host tier; clear errors for bad budgets and bad expert bytes;
the trace / bench cache / bench swap commands end to end, and the planner reading trace.bin."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from moeswap.cli import main
from moeswap.config import load_config
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.experts.trace import MAGIC, TraceRecorder, model_meta, read_trace, write_trace
from moeswap.formats.checkpoint import CheckpointError
from moeswap.models.loader import LoadOptions, load_model

PROMPT = list(range(7, 27))
CFG = GenerationConfig(max_tokens=10, stop_ids=())


def expert_bytes(store) -> int:
    return sum(store.fast.cost(k) for k in store.index.entries)


@pytest.fixture(scope="module")
def reference(tiny_k3_dir, tmp_path_factory):
    """All-resident greedy tokens, the total expert bytes, and a trace of that run (static's profile and
    Belady's future)."""
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    store.trace = TraceRecorder(model_meta(model, store, str(tiny_k3_dir)))
    tokens = generate(model, PROMPT, CFG).tokens
    path = write_trace(store.trace.trace, tmp_path_factory.mktemp("trace") / "trace.bin")
    return tokens, expert_bytes(store), str(path)


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "static", "belady"])
def test_tokens_identical_at_10_percent(tiny_k3_dir, reference, policy):
    tokens, total, trace = reference
    for prefetch in ("none", "next-layer"):
        model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=total // 10, expert_policy=policy,
                                                           prefetch=prefetch, expert_profile=trace))
        try:
            assert generate(model, PROMPT, CFG).tokens == tokens, (policy, prefetch)
        finally:
            store.close()
        s = store.stats
        assert store.fast.used <= store.fast.capacity and s.misses > 0 and s.disk_reads >= s.misses - s.prefetch.late
        assert store.source.buffers.reused > 0  # reads went into evicted experts' buffers, tokens unchanged
        p = s.prefetch
        if prefetch == "next-layer":
            assert p.loaded > 0 and p.predicted > 0 and p.actual > 0
            assert p.precision == p.correct / p.predicted and p.recall == p.correct / p.actual
        else:
            assert p.loaded == p.predicted == 0 and p.precision is None and p.recall is None  # undefined


def test_decoded_copies_and_a_host_tier_give_the_same_tokens(tiny_k3_dir, reference):
    tokens, total, _ = reference
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=total * 8 // 10, decoded_experts=True,
                                                       host_memory=total // 2, prefetch="next-layer"))
    try:
        assert generate(model, PROMPT, CFG).tokens == tokens
    finally:
        store.close()
    assert store.fast.cost(min(store.index.entries)) > 7 * store.tiers[1].cost(min(store.index.entries))  # fp32 vs 4.25 bits
    assert store.stats.tiers["host"].hits > 0 and store.tiers[1].used <= store.tiers[1].capacity


def test_prefetch_reads_natively_or_on_python_threads_with_the_same_tokens(tiny_k3_dir, reference):
    from moeswap.experts.prefetch import Prefetcher
    from moeswap.experts.reads import native_library
    from moeswap.models.loader import attach_store

    tokens, total, _ = reference
    for native in (True, False):
        model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=total // 10, prefetch="next-layer"))
        store.prefetcher.close()
        store.prefetcher = Prefetcher(store, native=native)
        attach_store(model, store)
        assert store.prefetcher.reads.native == (native and native_library() is not None)
        try:
            assert generate(model, PROMPT, CFG).tokens == tokens, native
        finally:
            store.close()
        assert store.stats.prefetch.loaded > 0 and not store._inflight and store._reserved == [0]


def test_float_experts_swap_too(tiny_linear_dir):
    model, store = load_model(tiny_linear_dir, LoadOptions(expert_memory=1 << 30))
    want = generate(model, PROMPT, CFG).tokens
    budget = expert_bytes(store) // 10
    model, store = load_model(tiny_linear_dir, LoadOptions(expert_memory=budget, prefetch="next-layer"))
    try:
        assert generate(model, PROMPT, CFG).tokens == want
    finally:
        store.close()


def test_routed_experts_are_not_parameters(tiny_k3_dir):
    model, _ = load_model(tiny_k3_dir, LoadOptions(prefetch="next-layer"))
    assert not any("experts." in name and "shared" not in name for name in model.state_dict())
    assert model.expert_lookahead is not None


def test_budget_below_one_layer_is_a_startup_error(tiny_k3_dir, capsys):
    with pytest.raises(ValueError, match=r"--expert-memory 1000 B is smaller than one layer's active experts: 4 x"):
        load_model(tiny_k3_dir, LoadOptions(expert_memory=1000))
    assert main(["generate", str(tiny_k3_dir), "--prompt", "hi", "--expert-memory", "1KB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "smaller than one layer's active experts" in err and "Traceback" not in err


def _expert_tensor(store, layer, expert, tensor="w1.weight_scale"):
    names = store.index.names(layer, expert)
    proj, kind = tensor.split(".")
    return store.ckpt.info(names[proj][kind])


@pytest.mark.parametrize("prefetch", ["none", "next-layer"])  # next-layer: reads on the reader threads too
def test_corrupt_expert_bytes_name_layer_expert_and_file(tiny_k3_dir, copy_model, prefetch):
    path = copy_model(tiny_k3_dir)
    model, store = load_model(path, LoadOptions(prefetch=prefetch))
    for e in range(model.config.moe.num_experts):  # every expert of layer 1: whichever is routed to fails
        info = _expert_tensor(store, 1, e)
        with open(info.file, "r+b") as f:
            f.seek(info.offset)
            f.write(b"\xff")
    with pytest.raises(CheckpointError) as err:
        generate(model, PROMPT, CFG)
    msg = str(err.value)
    assert "layer 1 expert" in msg and "NaN scale bytes" in msg and info.file.name in msg


@pytest.mark.parametrize("prefetch", ["none", "next-layer"])  # next-layer: reads on the reader threads too
def test_expert_file_truncated_mid_run(tiny_k3_dir, copy_model, prefetch):
    path = copy_model(tiny_k3_dir)
    model, store = load_model(path, LoadOptions(prefetch=prefetch))
    info = _expert_tensor(store, 1, 0)
    os.truncate(info.file, info.offset)  # every expert stored after this point is gone
    with pytest.raises(CheckpointError) as err:
        for _ in range(3):
            generate(model, list(range(3, 40)), CFG)
    msg = str(err.value)
    assert "layer " in msg and "expert " in msg and info.file.name in msg and "shrank" in msg


@pytest.mark.parametrize("prefetch", ["none", "next-layer"])  # next-layer: reads on the reader threads too
def test_expert_file_removed_mid_run(tiny_k3_dir, copy_model, prefetch):
    path = copy_model(tiny_k3_dir)
    model, store = load_model(path, LoadOptions(prefetch=prefetch))
    files = {_expert_tensor(store, 1, e).file for e in range(model.config.moe.num_experts)}
    for f in files:
        f.rename(f.with_suffix(".moved"))
    with pytest.raises(CheckpointError) as err:
        generate(model, PROMPT, CFG)
    msg = str(err.value)
    assert "layer 1 expert" in msg and any(f.name in msg for f in files) and "No such file" in msg


def test_generate_stats_and_flags(tiny_k3_dir, capsys, strict_json):
    argv = ["generate", str(tiny_k3_dir), "--prompt", "hello", "--max-tokens", "4", "--ignore-eos", "--stats",
            "--expert-memory", "40KB", "--expert-policy", "lru", "--prefetch", "next-layer"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "experts: fast " in err and "prefetch precision" in err and "disk " in err
    assert "decode steps in one C call: 3 of 3" in err  # swapping MoE layers run in the model between calls
    assert main(argv[:-6] + ["--json", "--expert-policy", "none"]) == 0
    data = strict_json(capsys.readouterr().out)
    books = data["expert_store"]  # no cache: every expert use misses and is read from disk, each time
    assert books["hits"] == 0 and books["misses"] == books["disk_reads"] > 0 and books["hit_rate"] == 0
    assert books["tiers"]["fast"]["bytes_in"] == 0
    assert books["bytes_read"] == books["disk_reads"] * 3 * 32 * 64 * 17 // 32  # 3 MXFP4 [32, 64]: 17 B / 32 weights
    assert data["native_decode_steps"] == 3


def test_trace_bench_cache_and_planner(tiny_k3_dir, tmp_path, capsys, strict_json):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n\nOnce upon a time\n")
    trace_path = tmp_path / "trace.bin"
    assert main(["trace", str(tiny_k3_dir), "--prompts", str(prompts), "-o", str(trace_path),
                 "--max-tokens", "6", "--ignore-eos"]) == 0
    assert "2 prompts, 12 tokens, 12 steps" in capsys.readouterr().out
    trace = read_trace(trace_path)
    assert trace.meta["moe_layers"] == [1, 2, 3, 4, 5] and trace.num_steps == 12
    data = trace_path.read_bytes()
    (meta_len,) = struct.unpack_from("<I", data, len(MAGIC) + 4)  # after the magic and the format version
    assert strict_json(data[len(MAGIC) + 8:len(MAGIC) + 8 + meta_len].decode()) == trace.meta
    assert all(len(ids) == len(set(ids)) for _, _, ids in trace.events())

    out = tmp_path / "cache"
    assert main(["bench", "cache", "--trace", str(trace_path), "--budgets", "3,10,50,100", "--out-dir", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 3% | 2 |" in text and "below one layer's 4 active experts" in text
    result = strict_json((out / "cache-hit-rate.json").read_text())
    for row in result["rows"][1:]:
        rates = row["hit_rate"]
        assert all(rates[p] <= rates["belady"] + 1e-12 for p in rates) and row["best_online"] in ("lru", "lfu", "lfru")
    assert (out / "cache-hit-rate.png").read_bytes()[:4] == b"\x89PNG"

    from moeswap.planner.cli import _trace

    counts = _trace(str(trace_path))
    assert len(counts) == 6 and counts[0] == () and sum(map(sum, counts)) == len(trace.experts)
    static = tmp_path / "static.bin"
    write_trace(trace, static)
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=30_000, expert_policy="static",
                                                       expert_profile=str(static)))
    assert store.policies[0].name == "static"


def test_bad_trace_file(tmp_path, capsys):
    bad = tmp_path / "trace.bin"
    bad.write_bytes(b"not a trace")
    assert main(["bench", "cache", "--trace", str(bad)]) == 2
    assert "not a moeswap routing trace" in capsys.readouterr().err
    bad.write_bytes(Path(bad).read_bytes()[:0] + b"MSWTRACE\x01\x00\x00\x00")
    with pytest.raises(ValueError, match="corrupt routing trace"):
        read_trace(bad)


def test_bench_swap_runs_and_checks_tokens(tiny_k3_dir, tmp_path):
    import torch

    from moeswap.bench.swap import format_report, run_bench

    r = run_bench(str(tiny_k3_dir), budgets=(10, 50), policies=("lru", "belady"), prompt_tokens=4, max_tokens=3,
                  out_dir=tmp_path, log=lambda *_: None, timed_prompts=2)
    assert len(r["runs"]) == 8 and all(c["same_tokens"] for c in r["runs"] + r["baselines"])
    # two prompts decoded one after another, each its own tokens (as generated alone), 2 decode steps each
    assert [len(t) for t in r["baselines"][0]["tokens"]] == [3, 3] and r["baselines"][0]["decoded"] == 4
    model, _ = load_model(tiny_k3_dir)
    first = torch.randint(0, model.config.vocab_size, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    assert generate(model, first, GenerationConfig(max_tokens=3, stop_ids=())).tokens == r["baselines"][0]["tokens"][0]
    assert r["baselines"][1]["hit_rate"] == 0 and r["baselines"][0]["hit_rate"] == 1
    cfg = load_config(tiny_k3_dir)  # no cache reads each token's top-k experts of every MoE layer, once
    per_token = cfg.moe.top_k * cfg.mlp_kinds.count("moe") * r["expert_bytes"] / 1e6
    assert r["baselines"][1]["disk_mb_per_token"] == pytest.approx(per_token)
    no_cache = r["baselines"][1]  # disk bytes per token times tokens per second
    assert r["baselines"][0]["disk_mb_per_token"] == 0
    assert no_cache["disk_gb_per_s"] == pytest.approx(no_cache["disk_mb_per_token"] * no_cache["tokens_per_s"] / 1e3)
    for c in r["runs"] + r["baselines"]:
        assert c["vs_resident"] == pytest.approx(c["tokens_per_s"] / r["reference_tokens_per_s"])
    text = format_report(r)
    assert "| lru + next-layer prefetch |" in text and "All configurations produced the all-resident tokens" in text
    assert (tmp_path / "swap-trace.bin").exists()


def test_bench_swap_command_writes_timestamped_reports(tiny_k3_dir, tmp_path, capsys, strict_json):
    out = tmp_path / "results"  # made if missing, as the other benches' --out-dir
    assert main(["bench", "swap", str(tiny_k3_dir), "--budgets", "50", "--policies", "lru", "--max-tokens", "2",
                 "--prompt-tokens", "3", "--repeats", "1", "--warmup-tokens", "2", "--out-dir", str(out)]) == 0
    (md,), (js,) = out.glob("swap-*.md"), out.glob("swap-*.json")
    assert "| lru |" in md.read_text() and strict_json(js.read_text())["runs"]
    assert str(md) in capsys.readouterr().out.splitlines()[-1]


def test_resident_expert_table_gives_the_fetch_paths_logits(tiny_k3_dir, monkeypatch):
    """With every expert resident for good (the fast tier holds them all), decode steps go from the router
    to the grouped kernel through each layer's pointer table (cpu_kernels.moe_resident; K3's latent MoE
    in one call, latent_moe_resident): the same logits bit for bit as the store's fetch, and the same hit
    count; with a budget that evicts, the tables follow the fast tier and the store's books are the same."""
    import torch

    from moeswap.experts.executors import ResidentTableExecutor
    from moeswap.ops import cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip("no CPU kernel")
    calls = []
    real = cpu_kernels.CpuKernels.moe_resident
    monkeypatch.setattr(cpu_kernels.CpuKernels, "moe_resident", lambda self, *a: calls.append(1) or real(self, *a))
    latent_calls = []  # whether each K3 latent call (down projection, experts, norm, up projection) ran
    real_latent = cpu_kernels.CpuKernels.latent_moe_resident

    def latent(self, *a):
        got = real_latent(self, *a)
        latent_calls.append(got is not None)
        return got

    monkeypatch.setattr(cpu_kernels.CpuKernels, "latent_moe_resident", latent)

    def decode_logits(options: LoadOptions):
        model, store = load_model(tiny_k3_dir, options)
        state = model.make_state(batch=3, dtype=torch.float32)
        prompt = torch.tensor([PROMPT[:6], PROMPT[6:12], PROMPT[12:18]])
        with torch.inference_mode():
            outs = [model(prompt, state)]  # prefill: the store's path (and the tables fill)
            for _ in range(4):
                outs.append(model(outs[-1][:, -1:].argmax(-1), state))
        return torch.cat([o[:, -1] for o in outs]), store

    table_logits, store = decode_logits(LoadOptions(expert_memory=1 << 30))
    assert store.can_evict is False and len(calls) > 0 and any(latent_calls)
    hits = store.stats.fast.hits
    monkeypatch.setattr(ResidentTableExecutor, "step_table", lambda self, h, ids: None)  # both table paths off
    fetch_logits, fetch_store = decode_logits(LoadOptions(expert_memory=1 << 30))
    assert torch.equal(table_logits, fetch_logits) and fetch_store.stats.fast.hits == hits
    # a store that evicts: the tables mirror its fast tier, the same logits and the same books as the fetches
    small_budget = LoadOptions(expert_memory=expert_bytes(store) * 9 // 10)  # some layer steps hit every expert
    fetch_logits, fetch_store = decode_logits(small_budget)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels.CpuKernels, "latent_moe_resident", latent)
    latent_calls.clear()
    table_logits, small = decode_logits(small_budget)
    books = lambda s: (s.stats.hits, s.stats.misses, s.stats.tiers["fast"].evictions, sorted(s.fast.keys()))
    assert small.can_evict and any(latent_calls) and small.stats.tiers["fast"].evictions > 0
    assert torch.equal(table_logits, fetch_logits) and books(small) == books(fetch_store)


def test_bench_swap_takes_text_prompts(tiny_k3_dir, tmp_path, strict_json):
    from moeswap.text.tokenizer import load_tokenizer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(argv):\n\nclass Stack:\n")
    out = tmp_path / "results"
    assert main(["bench", "swap", str(tiny_k3_dir), "--budgets", "50", "--policies", "lru", "--max-tokens", "2",
                 "--prompts", str(prompts), "--repeats", "1", "--warmup-tokens", "2", "--out-dir", str(out)]) == 0
    r = strict_json(next(out.glob("swap-*.json")).read_text())
    assert r["text_prompts"] is True
    assert r["prompt_tokens"] == len(load_tokenizer(tiny_k3_dir).encode("def main(argv):"))
    assert "text prompt" in next(out.glob("swap-*.md")).read_text()


def test_bench_swap_prompts_file_problems_are_one_line_errors(tiny_k3_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    for path, message in ((tmp_path / "missing.txt", "expected a text file with one prompt per line"),
                          (empty, "the file has no prompts")):
        assert main(["bench", "swap", str(tiny_k3_dir), "--prompts", str(path), "--out-dir", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeswap: error: ") and message in err and err.count("\n") == 1


def test_bench_swap_refuses_fewer_than_one_timed_prompt_in_one_line(tiny_k3_dir, tmp_path, capsys):
    out = tmp_path / "r"
    for bad in ("0", "-2"):
        assert main(["bench", "swap", str(tiny_k3_dir), "--timed-prompts", bad, "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeswap: error: ") and f"--timed-prompts must be >= 1, got {bad}" in err
        assert err.count("\n") == 1
    assert not out.exists()  # refused before anything ran or was written
