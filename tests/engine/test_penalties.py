"""Repetition penalties (engine.sampling.penalize, applied by the scheduler per sequence): against a direct
float64 computation of their definitions, and in the engine: greedy decoding with a large frequency penalty
never repeats a token, neutral values give today's tokens, a penalized row leaves its batch neighbours alone."""

import pytest
import torch

from moeswap.engine.sampling import SamplingParams, penalize
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.models.loader import LoadOptions, load_model
from moeswap.tiny import write_tiny_model


def _oracle(logits, prompt, generated, presence, frequency, repetition):
    out = [float(x) for x in logits]
    for t in set(prompt) | set(generated):  # transformers / llama.cpp
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(generated):  # OpenAI
        out[t] -= frequency * generated.count(t) + presence
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("presence,frequency,repetition", [(0.0, 0.0, 1.0), (0.7, 0.0, 1.0), (0.0, -1.3, 1.0),
                                                           (0.0, 0.0, 1.8), (0.0, 0.0, 0.6), (-0.4, 2.0, 1.3)])
def test_penalize_equals_the_definitions(presence, frequency, repetition):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, generator=g) * 3
    logits[4] = 0.0  # the repetition penalty's boundary: 0 * p
    prompt, generated = [1, 4, 4, 9], [2, 2, 2, 9, 7, 4]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    before = logits.clone()
    got = penalize(logits, params, prompt, generated)
    assert torch.equal(logits, before)  # a new tensor: the scheduler's raw logits stay for logprobs
    want = _oracle(logits.tolist(), prompt, generated, presence, frequency, repetition)
    # one fp32 rounding per operation on values below 2**4: a few ulps of 16
    torch.testing.assert_close(got.double(), want, rtol=0, atol=8 * 16 * torch.finfo(torch.float32).eps)
    if not params.penalized:
        assert got is logits


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.01),
                                dict(frequency_penalty=float("nan")), dict(presence_penalty="1"),
                                dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
                                dict(repetition_penalty=float("inf")), dict(repetition_penalty=True)])
def test_out_of_range_penalties_are_refused_by_name(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("k3") / "m", "kimi_k3", "tiny", seed=4)
    return load_model(path, LoadOptions(dtype="float32"))[0]


PROMPT = [1, 2, 3, 4]


def _run(model, *samplings, n=40):
    sched = Scheduler(model, EngineConfig(max_batch=4, max_len=128))
    return [r.tokens for r in sched.run([Request(PROMPT, n, s) for s in samplings])]


def test_greedy_with_a_large_frequency_penalty_never_repeats(k3):
    base, neutral, penalized = _run(k3, SamplingParams(), SamplingParams(0.0, 0, 1.0, 0.0, 0.0, 1.0),
                                    SamplingParams(frequency_penalty=2.0))
    assert len(set(base)) < len(base)  # the tiny model repeats itself without the penalty
    assert neutral == base
    assert len(set(penalized)) == len(penalized)
    # up to its first repeat greedy chose fresh tokens, which the penalty does not lower: the same ones
    first = next(i for i, t in enumerate(base) if t in base[:i])
    assert penalized[:first] == base[:first] and penalized[first] != base[first]
    # a penalized row in the batch leaves its neighbour's tokens as they are alone
    assert _run(k3, SamplingParams(), SamplingParams(frequency_penalty=2.0)) == [base, penalized]


def test_repetition_penalty_counts_the_prompt(k3):
    # the prompt's tokens are penalized too: a huge penalty keeps greedy off them and off its own output
    pen, = _run(k3, SamplingParams(repetition_penalty=1e6), n=8)
    assert not set(pen) & set(PROMPT) and len(set(pen)) == len(pen)
