"""Chunked prefill interleaved with decode: a step prefills at most `prefill_chunk` prompt tokens (pieces
of one or more prompts) and then decodes every sequence past its prefill, so a long prompt joining a
running batch never stalls it; every request's greedy tokens stay those it gets alone."""

import pytest
import torch

from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def model(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, "tiny", seed=4)
    return load_model(path, LoadOptions(dtype="float32"))[0]


def _tokens(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, prompt, max_tokens, chunk):
    engine = EngineConfig(max_batch=1, max_len=256, prefill_chunk=chunk)
    return Scheduler(model, engine).run([Request(prompt, max_tokens)])[0].tokens


def _steps(sched):
    """Step until idle: per step, the (id, token) of its events and the prompt tokens it prefilled."""
    out = []
    while sched.busy:
        before = sched.stats.prefill_tokens
        events = sched.step()
        out.append(([(e.id, e.token) for e in events], sched.stats.prefill_tokens - before))
    return out


def test_a_long_prompt_joining_a_running_batch_never_stalls_it(model):
    chunk = 16
    a, b, long = _tokens(4, 1), _tokens(7, 2), _tokens(100, 3)  # long: 7 pieces of at most 16 tokens
    sched = Scheduler(model, EngineConfig(max_batch=3, max_len=256, prefill_chunk=chunk))
    sched.submit(Request(a, 12, id="a"))
    sched.submit(Request(b, 5, id="b"))  # leaves while `long` is still prefilling
    first = sched.step()
    assert [e.id for e in first] == ["a", "b"]  # both prefills fit one step's 16 tokens
    sched.submit(Request(long, 6, id="long"))
    steps = _steps(sched)
    ids = [[i for i, _ in events] for events, _ in steps]
    assert all(0 < tokens <= chunk for _, tokens in steps[:7]) and sum(t for _, t in steps) == 100
    # `long` prefills over 7 steps; a and b get a decode step's token in each of them (b, until its 5th)
    assert ids[:4] == [["a", "b"]] * 4
    assert ids[4:6] == [["a"]] * 2
    assert ids[6] == ["long", "a"]  # the last piece's step: its first token, then the decode step's
    assert ids[7:10] == [["a", "long"]] * 3  # then it decodes with the batch
    got = {i: sched.finished[i].tokens for i in ("a", "b", "long")}
    assert got == {"a": _alone(model, a, 12, chunk), "b": _alone(model, b, 5, chunk),
                   "long": _alone(model, long, 6, chunk)}
    assert sched.finished["long"].prompt_tokens == 100 and sched.stats.prefill_tokens == 111


def test_one_step_prefills_pieces_of_several_prompts(model):
    chunk = 16
    prompts = {"p5": _tokens(5, 5), "p6": _tokens(6, 6), "p20": _tokens(20, 7), "p3": _tokens(3, 8)}
    sched = Scheduler(model, EngineConfig(max_batch=4, max_len=256, prefill_chunk=chunk))
    for name, p in prompts.items():
        sched.submit(Request(p, 6, id=name))
    steps = _steps(sched)
    firsts = {}
    for n, (events, _) in enumerate(steps):
        for i, _tok in events:
            firsts.setdefault(i, n)
    # step 0: p5 and p6 (11 tokens); p20's first piece (16) does not fit the 5 left, p3 does;
    # step 1: p20's first 16 tokens; step 2: its last 4
    assert firsts == {"p5": 0, "p6": 0, "p3": 0, "p20": 2}
    assert [t for _, t in steps[:3]] == [14, 16, 4]
    assert [i for i, _ in steps[1][0]] == ["p5", "p6", "p3"]  # p3 decodes with the first two while p20 prefills
    for name, p in prompts.items():
        assert sched.finished[name].tokens == _alone(model, p, 6, chunk), name


def test_requests_arriving_every_step_match_their_runs_alone(model):
    """Admission at every step, prompts longer and shorter than a piece, sequences leaving while others
    prefill (rows move), more requests than slots."""
    chunk = 24
    reqs = [Request(_tokens(n, 40 + i), m, id=i) for i, (n, m) in
            enumerate([(30, 3), (5, 9), (70, 4), (2, 1), (49, 7), (24, 5), (11, 2), (90, 3)])]
    sched = Scheduler(model, EngineConfig(max_batch=3, max_len=256, prefill_chunk=chunk))
    pending = list(reqs)
    while pending or sched.busy:
        if pending:
            sched.submit(pending.pop(0))
        before = sched.stats.prefill_tokens
        sched.step()
        assert sched.stats.prefill_tokens - before <= chunk
        assert len(sched.live) <= 3 and all(not s.done for s in sched.live)
    for r in reqs:
        assert sched.finished[r.id].tokens == _alone(model, r.prompt, r.max_tokens, chunk), r.id


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefill_chunk=0), "EngineConfig.prefill_chunk must be an integer >= 1, got 0"),
    (dict(max_batch=-1), "EngineConfig.max_batch must be an integer >= 1, got -1"),
    (dict(max_len=2.5), "EngineConfig.max_len must be an integer >= 1, got 2.5"),
])
def test_engine_config_is_validated(kwargs, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(**kwargs)
    assert str(info.value) == message


def test_an_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="request 0: the prompt is empty"):
        Scheduler(model, EngineConfig(max_batch=1, max_len=16)).submit(Request([], 2))
