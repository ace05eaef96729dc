"""Scheduler.abort: a waiting request leaves the queue, a running one leaves its slot at the next step;
each ends with one "abort" event and a Result, and the requests left get the tokens they get alone."""

import pytest
import torch

from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("k3") / "m", "kimi_k3", "tiny", seed=4)
    return load_model(path, LoadOptions(dtype="float32"))[0]


def _tokens(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, prompt, max_tokens):
    return Scheduler(model, EngineConfig(max_batch=1, max_len=128)).run([Request(prompt, max_tokens)])[0].tokens


def test_abort_waiting_and_running_requests(model):
    prompts = [_tokens(n, 20 + n) for n in (6, 11, 9)]
    sched = Scheduler(model, EngineConfig(max_batch=2, max_len=128))
    for i, p in enumerate(prompts):
        sched.submit(Request(p, 8, id=f"r{i}"))
    first = sched.step()  # r0 and r1 take the two slots; r2 waits
    assert sorted(e.id for e in first) == ["r0", "r1"] and len(sched.waiting) == 1
    assert sched.abort("r2") and not sched.waiting  # waiting: dropped at once
    assert sched.abort("r1")  # running: ends at the next step
    assert not sched.abort("r1") and not sched.abort("nobody")
    events = sched.step()
    ends = [(e.id, e.token, e.finish_reason) for e in events if e.finish_reason]
    assert sorted(ends) == [("r1", None, "abort"), ("r2", None, "abort")]
    assert [e.id for e in events if e.token is not None] == ["r0"]  # r1 took no decode step
    assert [s.req.id for s in sched.live] == ["r0"]  # r1's slot is free
    r1, r2 = sched.finished.pop("r1"), sched.finished.pop("r2")
    assert r1.finish_reason == r2.finish_reason == "abort"
    assert r1.tokens == _alone(model, prompts[1], 1) and r1.ttft_s is not None  # its prefill's token
    assert r2.tokens == [] and r2.ttft_s is None and r2.prompt_tokens == 9
    # a request submitted now takes the freed slot; both go on as they would alone
    sched.submit(Request(prompts[2], 5, id="late"))
    while sched.busy:
        sched.step()
    assert sched.finished["r0"].tokens == _alone(model, prompts[0], 8)
    assert sched.finished["late"].tokens == _alone(model, prompts[2], 5)
    assert not sched.abort("r0")  # finished: nothing to abort


def test_abort_from_run_callback_ends_the_run(model):
    sched = Scheduler(model, EngineConfig(max_batch=2, max_len=128))
    seen = []

    def on_token(ev):
        seen.append(ev)
        if ev.id == 1 and ev.token is not None and len([e for e in seen if e.id == 1]) == 3:
            sched.abort(1)

    res = sched.run([Request(_tokens(5, 1), 6), Request(_tokens(7, 2), 20)], on_token)
    assert res[0].finish_reason == "length" and len(res[0].tokens) == 6
    assert res[1].finish_reason == "abort" and len(res[1].tokens) == 3
    assert [e.finish_reason for e in seen if e.id == 1] == [None, None, None, "abort"]
    assert res[1].tokens == _alone(model, _tokens(7, 2), 3)


def test_abort_while_prefilling(model):
    chunk = 8
    a, long, late = _tokens(5, 3), _tokens(40, 4), _tokens(12, 5)
    sched = Scheduler(model, EngineConfig(max_batch=2, max_len=128, prefill_chunk=chunk))
    sched.submit(Request(a, 10, id="a"))
    sched.step()
    sched.submit(Request(long, 4, id="long"))
    sched.step()
    sched.step()  # long: 16 of its 40 tokens in the state
    assert sched.stats.prefill_tokens == 5 + 16 and sched.abort("long")
    events = sched.step()
    assert [(e.id, e.token is None, e.finish_reason) for e in events] == [("long", True, "abort"), ("a", False, None)]
    assert sched.stats.prefill_tokens == 5 + 16 and [s.req.id for s in sched.live] == ["a"]
    assert sched.finished["long"].tokens == [] and sched.finished["long"].ttft_s is None
    sched.submit(Request(late, 3, id="late"))  # into the slot long held, cleared
    while sched.busy:
        sched.step()
    engine = EngineConfig(max_batch=1, max_len=128, prefill_chunk=chunk)
    assert sched.finished["a"].tokens == Scheduler(model, engine).run([Request(a, 10)])[0].tokens
    assert sched.finished["late"].tokens == Scheduler(model, engine).run([Request(late, 3)])[0].tokens
