"""The continuous-batching scheduler: greedy tokens equal each request run alone, whatever joins or
leaves between steps, however prompts are chunked; slots are reused; timings are recorded."""

import time

import pytest
import torch

from moeswap.engine.sampling import SamplingParams
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import write_tiny_model


def _tokens(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, req: Request) -> list[int]:
    sched = Scheduler(model, EngineConfig(max_batch=1, max_len=128))
    return sched.run([Request(req.prompt, req.max_tokens, req.sampling, req.stop_ids)])[0].tokens


def test_sequences_join_and_leave_without_changing_tokens(model):
    # 5 requests, 2 slots: later requests join as earlier ones leave, at different steps
    reqs = [Request(_tokens(n, s), m) for s, (n, m) in enumerate([(5, 3), (30, 9), (12, 4), (70, 6), (1, 5)])]
    sched = Scheduler(model, EngineConfig(max_batch=2, max_len=128))
    for r in reqs:
        sched.submit(r)
    live_counts, order = [], []
    while sched.busy:
        events = sched.step()
        live_counts.append(len(sched.live))
        order += [e.id for e in events if e.finish_reason]
    results = {i: sched.finished[i] for i in range(len(reqs))}
    for i, r in enumerate(reqs):
        assert results[i].tokens == _alone(model, r), f"request {i}"
        assert len(results[i].tokens) == r.max_tokens and results[i].finish_reason == "length"
    assert max(live_counts) == 2 and order[:2] == [0, 2]  # short ones leave first, others take their slots
    # request 4 waits for a slot from before request 0's first token until after its last
    assert results[4].queued_s > results[0].decode_s > 0 and results[4].ttft_s >= results[4].queued_s


def test_batched_equals_single_with_stops_and_uneven_lengths(model):
    prompts = [_tokens(n, 10 + n) for n in (3, 17, 64, 65, 8, 40)]
    free = [_alone(model, Request(p, 10)) for p in prompts]
    stop = free[2][4]
    reqs = [Request(p, 10, stop_ids=(stop,)) for p in prompts]
    got = Scheduler(model, EngineConfig(max_batch=6, max_len=128)).run(reqs)
    for g, f in zip(got, free):
        want = f[: f.index(stop) + 1] if stop in f else f
        assert g.tokens == want and g.finish_reason == ("stop" if stop in f else "length")


def test_batched_logits_equal_alone_bit_for_bit(model):
    """Batching changes no number: each step's log-probabilities (the raw logits' log-softmax) of a request
    decoded with up to 8 others, joining and leaving at different steps, equal those it gets alone, bit for
    bit, and its greedy tokens with them (every decode kernel sums a token's rows in one order whatever the
    batch: ops/csrc/linear_bf16.c; tests/ops/test_batch_invariance.py)."""
    shapes = [(3, 12), (17, 6), (40, 12), (5, 9), (9, 12), (1, 7), (26, 12), (12, 10), (7, 12)]
    reqs = [Request(_tokens(n, 30 + n), m, logprobs=8, id=i) for i, (n, m) in enumerate(shapes)]
    sched = Scheduler(model, EngineConfig(max_batch=len(reqs), max_len=128))
    for r in reqs:
        sched.submit(r)
    events, widths = [], []
    while sched.busy:
        widths.append(sched.decoding)  # the rows of this step's decode
        events += sched.step()
    assert max(widths) == len(reqs) and len(set(widths)) > 3
    assert sched.stats.native_steps == sched.stats.decode_steps > 0  # the decode steps' C call
    for r in reqs:
        alone = []
        Scheduler(model, EngineConfig(max_batch=1, max_len=128)).run(
            [Request(r.prompt, r.max_tokens, logprobs=8)], on_token=alone.append)
        mine = [(e.token, e.logprob, e.top_logprobs) for e in events if e.id == r.id]
        assert mine == [(e.token, e.logprob, e.top_logprobs) for e in alone], f"request {r.id}"


def test_chunked_prefill_equals_one_forward(model):
    prompt = _tokens(150, 7)
    whole = Scheduler(model, EngineConfig(max_batch=1, max_len=200, prefill_chunk=512)).run([Request(prompt, 6)])
    chunked = Scheduler(model, EngineConfig(max_batch=1, max_len=200, prefill_chunk=37)).run([Request(prompt, 6)])
    assert chunked[0].tokens == whole[0].tokens


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    sampled = Request(_tokens(9, 3), 12, SamplingParams(temperature=1.2, top_p=0.9), seed=5)
    alone = Scheduler(model, EngineConfig(max_batch=1, max_len=64)).run([sampled])[0].tokens
    sampled = Request(_tokens(9, 3), 12, SamplingParams(temperature=1.2, top_p=0.9), seed=5)
    mixed = Scheduler(model, EngineConfig(max_batch=3, max_len=64)).run(
        [Request(_tokens(20, 1), 12), sampled, Request(_tokens(4, 2), 3)])
    assert mixed[1].tokens == alone


def test_stats_and_limits(model):
    sched = Scheduler(model, EngineConfig(max_batch=2, max_len=40))
    t0 = time.perf_counter()
    res = sched.run([Request(_tokens(10, 1), 5), Request(_tokens(20, 2), 3)])
    wall = time.perf_counter() - t0
    st = sched.stats
    assert st.prefill_tokens == 30 and st.decode_steps == 4 and st.decode_tokens == 4 + 2
    assert res[0].decoded == 4 and res[1].decoded == 2
    # The timings nest as the steps ran: both prefills, then 4 decode steps (request 1 leaves after 2).
    assert 0 < st.prefill_s + st.decode_s <= wall
    assert res[1].ttft_s >= st.prefill_s  # request 1 waited for request 0's prefill, then ran its own
    assert res[1].decode_s <= st.decode_s <= res[0].decode_s  # request 0's window also holds request 1's prefill
    assert res[0].tpot_s == pytest.approx(res[0].decode_s / 4) and res[1].tpot_s == pytest.approx(res[1].decode_s / 2)
    rates = st.as_dict()
    assert rates["prefill_tokens_per_s"] == pytest.approx(30 / st.prefill_s)
    assert rates["decode_tokens_per_s"] == pytest.approx(6 / st.decode_s)
    one = Scheduler(model, EngineConfig(max_batch=1, max_len=40))
    only = one.run([Request(_tokens(4, 1), 1)])[0]  # one token, from the prefill: nothing decoded
    assert only.tpot_s is None and one.stats.as_dict()["decode_tokens_per_s"] is None
    with pytest.raises(ValueError, match="max_len"):
        sched.submit(Request(_tokens(38, 3), 5))


def test_int8_expert_activations_batch_like_single_sequences(tmp_path, monkeypatch):
    from moeswap.ops import cpu_kernels

    path = write_tiny_model(tmp_path / "k3", "kimi_k3", "tiny", seed=4)
    with pytest.raises(ValueError, match="--expert-activations 'int4': expected one of fp32, int8"):
        load_model(path, LoadOptions(expert_activations="int4"))
    kernel = cpu_kernels.kernel()
    if kernel is None or not kernel.has_int8_activations:
        with pytest.raises(ValueError, match="needs the CPU kernel with AVX-512 VNNI"):
            load_model(path, LoadOptions(expert_activations="int8"))
        return
    model = load_model(path, LoadOptions(dtype="float32", expert_activations="int8"))[0]
    assert all(block.int8_activations for block in model.moe_blocks())
    calls, real_moe = [], type(kernel).moe

    def moe(self, *args, int8_activations=False):  # the binding's (x, kind, F, table, tokens, ..., y[, int8])
        calls.append(int8_activations if len(args) == 10 else args[10])
        return real_moe(self, *args[:10], int8_activations=calls[-1])

    monkeypatch.setattr(type(kernel), "moe", moe)
    prompts = [_tokens(n, 30 + n) for n in (4, 23, 9)]
    free = [_alone(model, Request(p, 8)) for p in prompts]
    got = Scheduler(model, EngineConfig(max_batch=3, max_len=64)).run([Request(p, 8) for p in prompts])
    assert [g.tokens for g in got] == free  # each token quantized on its own: the batch changes nothing
    assert calls and all(calls)
    monkeypatch.setattr(kernel, "has_int8_activations", False)
    with pytest.raises(ValueError, match="without VNNI"):
        load_model(path, LoadOptions(expert_activations="int8"))


def test_logprobs_are_the_raw_logits_log_softmax(model):
    """Request.logprobs: each event carries the chosen token's log-probability and the top k, equal to the
    log-softmax of the model's full forward at that position; requests without it get none."""
    prompt = _tokens(9, 5)
    events = []
    Scheduler(model, EngineConfig(max_batch=2, max_len=64)).run(
        [Request(prompt, 4, id="lp", logprobs=3), Request(_tokens(6, 6), 4, id="plain")], on_token=events.append)
    mine = [e for e in events if e.id == "lp" and e.token is not None]
    assert len(mine) == 4
    assert all(e.logprob is None and e.top_logprobs is None for e in events if e.id == "plain")
    with torch.no_grad():
        lp_TV = model(torch.tensor([prompt + [e.token for e in mine]]))[0].float().log_softmax(-1)
    for j, e in enumerate(mine):
        row = lp_TV[len(prompt) - 1 + j]
        assert e.logprob == pytest.approx(row[e.token].item(), abs=1e-4)
        top_v, top_i = row.topk(3)
        assert [t for t, _ in e.top_logprobs] == top_i.tolist()
        assert [v for _, v in e.top_logprobs] == pytest.approx(top_v.tolist(), abs=1e-4)
