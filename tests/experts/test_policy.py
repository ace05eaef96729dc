"""Cache policies on small access sequences: each evicts what its rule says, the lazy heap matches a
plain model, and Belady is optimal (never beaten, and equal to a brute-force optimum)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeswap.experts.keys import Key
from moeswap.experts.policy import LFRU, LFU, LRU, POLICIES, Belady, StaticHot, _Ranked, make_policy


def simulate(policy, seq, slots: int) -> int:
    """Demand paging with `slots` places: insert then record on a miss, as ExpertStore does. Hits."""
    resident, hits = set(), 0
    for key in seq:
        if key in resident:
            hits += 1
        else:
            if len(resident) >= slots:
                resident.discard(policy.victim())
            resident.add(key)
            policy.insert(key)
        policy.record(key)
    return hits


def K(*experts):
    return [Key(0, e) for e in experts]


def fill(policy, seq):
    for key in seq:
        policy.insert(key)
        policy.record(key)
    return policy


def test_lru_evicts_the_oldest_use():
    p = fill(LRU(), K(1, 2, 3))
    p.record(Key(0, 1))
    assert p.victim() == Key(0, 2) and p.victim() == Key(0, 3) and p.victim() == Key(0, 1) and p.victim() is None


def test_lfu_evicts_the_least_used_then_the_oldest():
    p = fill(LFU(), K(1, 1, 1, 2, 2, 3, 4))
    assert p.victim() == Key(0, 3)
    assert p.victim() == Key(0, 4)
    assert p.victim() == Key(0, 2)


def test_lfru_lets_a_once_hot_expert_age_out():
    """LFU keeps an expert that was hot long ago; LFRU's decayed score lets a recently busy one win."""
    old_hot = K(1) * 20
    recent = [k for _ in range(12) for k in K(2, 3)]
    for policy, expected in ((LFU(), Key(0, 2)), (LFRU(half_life=4), Key(0, 1))):
        fill(policy, old_hot + recent)
        assert policy.victim() == expected, policy.name


def test_prefetched_but_unused_goes_first():
    for policy in (LRU(), LFU(), LFRU()):
        fill(policy, K(1, 2))
        policy.insert(Key(0, 9))  # loaded by prefetch, never asked for
        assert policy.victim() == Key(0, 9), policy.name


def test_static_hot_keeps_the_profiled_experts():
    profile = {Key(0, 1): 50, Key(0, 2): 40}
    p = StaticHot(profile)
    seq = K(1, 2, 3, 4, 5, 6, 1, 2, 7, 8, 1, 2)
    assert simulate(p, seq, 3) == 4  # 1 and 2 stay; the rest pass through the third slot
    assert simulate(LRU(), seq, 3) < 4


def test_victim_skips_pinned():
    p = fill(LRU(), K(1, 2, 3))
    assert p.victim(pinned={Key(0, 1), Key(0, 2)}) == Key(0, 3)
    assert p.victim(pinned={Key(0, 1), Key(0, 2)}) is None
    assert p.victim() == Key(0, 1)


@pytest.mark.parametrize("name", ["lru", "lfu", "lfru", "static", "belady"])
def test_a_run_of_victims_with_the_pins_set_aside_is_the_one_at_a_time_run(name):
    """victim(pinned, aside) ... put_back(aside): the same victims as victim(pinned) each time, and
    afterwards the pinned residents rank as before (ExpertStore's batched loads rely on it)."""
    keys = [Key(0, e) for e in range(12)]
    uses = [keys[i % 7] for i in range(40)] + keys
    runs = []
    for aside in (None, []):
        p = make_policy(name, profile={k: k.expert % 5 for k in keys}, future=uses + uses)
        for k in uses:
            if k not in p._resident:
                p.insert(k)
            p.record(k)
        pinned = {keys[0], keys[3], keys[8], keys[11]}
        got = [p.victim(pinned) if aside is None else p.victim(pinned, aside) for _ in range(6)]
        if aside is not None:
            p.put_back(aside)
            assert aside == []
        runs.append(got + [p.victim() for _ in range(6)])  # the pinned ones are back in the running
    assert runs[0] == runs[1] and set(runs[0][6:]) >= {keys[0], keys[3], keys[8], keys[11]}


def brute_force_best(seq, slots) -> int:
    """Most hits any eviction choice achieves (exhaustive; tiny inputs only)."""
    best = 0

    def go(i, resident, hits):
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        key = seq[i]
        if key in resident:
            go(i + 1, resident, hits + 1)
        elif len(resident) < slots:
            go(i + 1, resident | {key}, hits)
        else:
            for out in resident:
                go(i + 1, (resident - {out}) | {key}, hits)

    go(0, frozenset(), 0)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=9), st.integers(1, 3))
def test_belady_is_optimal(experts, slots):
    seq = K(*experts)
    assert simulate(Belady(seq), seq, slots) == brute_force_best(seq, slots)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=60), st.integers(1, 6))
def test_belady_never_loses(experts, slots):
    seq = K(*experts)
    best = simulate(Belady(seq), seq, slots)
    for p in (LRU(), LFU(), LFRU(half_life=8), StaticHot({k: 1 for k in seq})):
        assert simulate(p, seq, slots) <= best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["set", "pop"]), st.integers(0, 6), st.integers(0, 9)), max_size=80))
def test_ranked_matches_a_plain_dict(ops):
    ranked, plain, order = _Ranked(), {}, itertools.count()
    for op, key, prio in ops:
        if op == "set":
            ranked.set(key, prio)
            plain[key] = (prio, next(order))
        else:
            pinned = {key}
            got = ranked.pop_min(pinned)
            free = {k: v for k, v in plain.items() if k not in pinned}
            want = min(free, key=free.get) if free else None
            assert got == want
            plain.pop(want, None)
    assert len(ranked) == len(plain)


def test_make_policy_names_and_needs():
    assert set(POLICIES) == {"lru", "lfu", "lfru", "static", "belady"}
    assert isinstance(make_policy("lfru", half_life=10), LFRU)
    with pytest.raises(ValueError, match="expected one of"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="--expert-profile"):
        make_policy("static")
    with pytest.raises(ValueError, match="future"):
        make_policy("belady")
    with pytest.raises(ValueError, match="half_life"):
        LFRU(half_life=0)
