"""Token constraints (engine.sampling.TokenConstraint, Request.constraint: structured output's hook), with a
tokenizer-free stand-in: a constrained request chooses only allowed tokens, greedy among them is the masked
argmax of the model's full forward, it ends ("stop") on the token that completes it; an unconstrained request
beside it gives the tokens it gives alone (greedy and seeded sampling); a constraint that allows any token for a
while (no mask: structured output waiting for reasoning to end) leaves those tokens what they are without it;
sample() keeps its mask through top-k and top-p."""

import pytest
import torch

from moeswap.engine.sampling import SamplingParams, sample
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler


class EveryKth:
    """Allows the ids divisible by k; done after n tokens. Records what it was told."""

    def __init__(self, k: int, n: int) -> None:
        self.k, self.n, self.seen, self.asked = k, n, [], 0

    def allowed(self, mask_V: torch.Tensor) -> bool:
        assert not mask_V.any()  # every constraint is given a blank mask (the scheduler reuses untouched ones)
        self.asked += 1
        mask_V[::self.k] = True
        return True

    def advance(self, token: int) -> None:
        self.seen.append(token)

    @property
    def done(self) -> bool:
        return len(self.seen) >= self.n


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _masked_greedy(model, prompt, n: int, k: int) -> list[int]:
    """The oracle: each token the argmax over ids divisible by k of the full forward, no state, no engine."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1]
        seq.append(int(logits[::k].argmax()) * k)
    return seq[len(prompt):]


def _run(model, reqs, max_batch=4):
    return Scheduler(model, EngineConfig(max_batch=max_batch, max_len=128)).run(reqs)


def test_a_constrained_request_chooses_among_the_allowed_tokens_and_ends_when_done(model):
    prompt = _prompt(7, 1)
    c = EveryKth(3, 5)
    res = _run(model, [Request(prompt, 20, constraint=c)])[0]
    assert res.finish_reason == "stop" and len(res.tokens) == 5
    assert res.tokens == c.seen == _masked_greedy(model, prompt, 5, 3)
    assert c.asked == 5
    # sampled: every token allowed
    c = EveryKth(7, 9)
    res = _run(model, [Request(prompt, 20, SamplingParams(temperature=1.5, top_k=40, top_p=0.9), seed=3,
                               constraint=c)])[0]
    assert res.tokens == c.seen and len(res.tokens) == 9 and all(t % 7 == 0 for t in res.tokens)
    # max_tokens first: "length"
    res = _run(model, [Request(prompt, 3, constraint=EveryKth(3, 5))])[0]
    assert res.finish_reason == "length" and len(res.tokens) == 3


def test_unconstrained_requests_beside_a_constrained_one_give_their_tokens_alone(model):
    greedy = Request(_prompt(9, 2), 10)
    sampled = Request(_prompt(5, 3), 10, SamplingParams(temperature=1.1, top_p=0.95), seed=11)
    alone = [r.tokens for r in _run(model, [Request(greedy.prompt, 10)], 1)
             + _run(model, [Request(sampled.prompt, 10, sampled.sampling, seed=11)], 1)]
    constrained = Request(_prompt(12, 4), 10, SamplingParams(temperature=0.8), seed=1, constraint=EveryKth(5, 6))
    mixed = _run(model, [greedy, constrained, sampled])
    assert [mixed[0].tokens, mixed[2].tokens] == alone
    assert mixed[1].finish_reason == "stop" and all(t % 5 == 0 for t in mixed[1].tokens)


class NoneAllowed(EveryKth):
    def allowed(self, mask_V: torch.Tensor) -> bool:
        return True


def test_a_constraint_that_allows_nothing_is_an_error_not_a_random_token(model):
    with pytest.raises(RuntimeError, match="NoneAllowed allowed no token"):
        _run(model, [Request(_prompt(3, 5), 4, constraint=NoneAllowed(1, 1))])


class FreeFirst(EveryKth):
    """Any token (no mask) for the first `free` tokens, then the ids divisible by k."""

    def __init__(self, free: int, k: int, n: int) -> None:
        super().__init__(k, n)
        self.free = free

    def allowed(self, mask_V: torch.Tensor) -> bool:
        assert not mask_V.any()
        return False if len(self.seen) < self.free else super().allowed(mask_V)


def test_a_constraint_that_allows_any_token_leaves_the_tokens_as_they_are_without_it(model):
    """The free tokens are the unconstrained request's, bit for bit (greedy rows alone take the batched argmax,
    sampled ones draw as without a constraint), batched with other requests; the mask applies after them."""
    greedy, other, sampled = _prompt(8, 6), _prompt(6, 7), _prompt(5, 8)
    params = SamplingParams(temperature=1.2, top_k=50)

    def requests(c0=None, c2=None):
        return [Request(greedy, 12, constraint=c0), Request(other, 12), Request(sampled, 12, params, seed=9,
                                                                                  constraint=c2)]

    free = _run(model, requests())
    for frees in ((12, 12), (5, 2)):  # (5, 2): steps where one row is free and the other masked
        cs = [FreeFirst(n, 4, 99) for n in frees]
        got = _run(model, requests(*cs))
        assert got[1].tokens == free[1].tokens
        for r, alone, c, n in zip((got[0], got[2]), (free[0], free[2]), cs, frees):
            assert r.tokens[:n] == alone.tokens[:n] and c.asked == 12 - n
            assert all(t % 4 == 0 for t in r.tokens[n:])
    # greedy after the free tokens: the masked argmax of the full forward from there
    assert got[0].tokens[5:] == _masked_greedy(model, greedy + got[0].tokens[:5], 7, 4)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=2.0),
                                    SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.5)])
def test_sample_chooses_only_allowed_tokens(params):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 64, generator=g) * 4
    allowed = torch.zeros(1, 64, dtype=torch.bool)
    allowed[0, [3, 17, 40, 41]] = True
    drawn = {int(sample(logits, params, torch.Generator().manual_seed(s), allowed)) for s in range(200)}
    assert drawn <= {3, 17, 40, 41}
    if params.temperature == 0:
        assert drawn == {max([3, 17, 40, 41], key=lambda t: logits[0, t])}
    elif params.top_k == 3:  # top-k among the allowed: the 3 best of them
        best = sorted([3, 17, 40, 41], key=lambda t: -logits[0, t])[:3]
        assert drawn == set(best)
