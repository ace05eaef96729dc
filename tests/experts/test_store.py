"""ExpertStore mechanics on fake tiers: fastest tier first, promotion, byte budgets, pins, statistics,
the no-cache mode, prefetch (loads, accuracy, never a hang) and errors from below."""

from __future__ import annotations

import math
import threading
import time

import pytest

from moeswap.experts.keys import Key
from moeswap.experts.policy import LRU, make_policy
from moeswap.experts.prefetch import Prefetcher
from moeswap.experts.stats import StoreStats, TierStats
from moeswap.experts.store import ExpertStore
from moeswap.experts.tiers import MemoryTier, Tier

SIZE = 10  # bytes per fake expert


class Blob:
    def __init__(self, key):
        self.key, self.nbytes = key, SIZE


class Source(Tier):
    """Every expert; counts reads; can be slowed down or made to fail for one key."""

    name, capacity = "disk", math.inf

    def __init__(self, delay: float = 0.0, bad: Key | None = None):
        self.reads, self.delay, self.bad = [], delay, bad
        self._lock = threading.Lock()

    def get(self, key):
        if self.delay:
            time.sleep(self.delay)
        if key == self.bad:
            raise ValueError(f"{key}: cannot decode")
        with self._lock:
            self.reads.append(key)
        return Blob(key)

    def stored_bytes(self, key):
        return SIZE


def make_store(slots=4, host_slots=0, policy="lru", **source_kw) -> tuple[ExpertStore, Source]:
    source = Source(**source_kw)
    tiers = [MemoryTier("fast", slots * SIZE, cost=lambda k: SIZE)]
    if host_slots:
        tiers.append(MemoryTier("host", host_slots * SIZE, cost=lambda k: SIZE))
    tiers.append(source)
    policies = [make_policy(policy) for _ in tiers[:-1]]
    return ExpertStore(tiers, policies, max_hint=8), source


def fetch(store, layer, ids):
    return [w.key for w in store.fetch(layer, ids)]


def test_hit_after_miss_and_budget_kept():
    store, source = make_store(slots=4)
    assert fetch(store, 1, [0, 1]) == [Key(1, 0), Key(1, 1)]
    assert fetch(store, 1, [0, 1]) == [Key(1, 0), Key(1, 1)]
    assert len(source.reads) == 2
    s = store.stats
    assert (s.hits, s.misses, s.disk_reads, s.disk_bytes, s.fast.bytes_in) == (2, 2, 2, 2 * SIZE, 2 * SIZE)
    for layer in range(2, 12):
        fetch(store, layer, [0, 1, 2])
        assert store.fast.used <= store.fast.capacity
    assert store.stats.fast.evictions > 0 and len(store.fast) == 4


def test_lru_evicts_in_order_and_pins_the_current_step():
    store, source = make_store(slots=3)
    fetch(store, 1, [0, 1, 2])
    fetch(store, 2, [0])  # evicts (1, 0), the least recently used
    assert Key(1, 0) not in store.fast and Key(1, 1) in store.fast
    # A step bigger than the budget still completes, one expert at a time (demand beats pins).
    assert len(fetch(store, 3, [0, 1, 2, 3, 4])) == 5
    assert store.fast.used <= store.fast.capacity


def test_host_tier_sits_between_fast_and_disk():
    store, source = make_store(slots=2, host_slots=6)
    fetch(store, 1, [0, 1, 2, 3])  # fast keeps 2, host keeps all 4
    fetch(store, 1, [0, 1])  # fast misses, host hits: no new disk reads
    assert len(source.reads) == 4
    host = store.stats.tiers["host"]
    assert host.hits == 2 and host.misses == 4 and host.bytes_in == 4 * SIZE
    assert list(store.stats.tiers) == ["fast", "host"]
    assert store.stats.as_dict()["tiers"]["host"]["hit_rate"] == pytest.approx(2 / 6)


def test_no_cache_reads_every_time():
    store, source = make_store(slots=0)
    for _ in range(3):
        fetch(store, 1, [0, 1])
    assert len(source.reads) == 6 and len(store.fast) == 0 and store.stats.hits == 0


def test_graph_holds_keep_an_expert_only_while_the_fast_tier_does():
    """What an autograd graph keeps for backward (store.hold): the expert itself while resident, counted in
    the tier's bytes; nothing once evicted (the backward fetches it again); nothing without a cache."""
    import gc

    store, source = make_store(slots=2)
    first = store.fetch(1, [0])[0]
    held = store.hold(1, 0, first)
    assert held.w is first and held.get() is first and store.graph_bytes() == SIZE
    assert store.stats.graph.held == 1
    fetch(store, 2, [0, 1])  # evicts (1, 0): the hold lets go, so the graph keeps no bytes outside the budget
    assert Key(1, 0) not in store.fast and held.w is None and store.stats.graph.released == 1
    assert store.graph_bytes() == 0 and store.fast.used <= store.fast.capacity
    again = held.get()  # the backward's fetch: a demand read, held again while resident
    assert again.key == Key(1, 0) and held.w is again and len(source.reads) == 4
    assert store.stats.graph.refetched == 1 and store.stats.graph.held == 2
    del held, again, first
    gc.collect()
    assert store.graph_bytes() == 0  # a freed graph holds nothing
    store.reset_stats()
    assert store.stats.as_dict()["graph"] == {"held": 0, "released": 0, "refetched": 0}
    nocache, source = make_store(slots=0)
    w = nocache.fetch(1, [3])[0]
    held = nocache.hold(1, 3, w)
    assert held.w is None and held.get().key == Key(1, 3) and len(source.reads) == 2


def test_source_errors_reach_the_caller_and_the_store_recovers():
    store, _ = make_store(slots=4, bad=Key(1, 3))
    experts = store.fetch(1, [2, 3])
    assert experts[0].key == Key(1, 2)
    with pytest.raises(ValueError, match="layer 1 expert 3: cannot decode"):
        experts[1]
    assert not store._inflight and store._reserved == [0]
    assert fetch(store, 1, [2]) == [Key(1, 2)]


def test_trace_records_steps():
    from moeswap.experts.trace import TraceRecorder

    store, _ = make_store(slots=8)
    store.trace = TraceRecorder({"num_layers": 3, "num_experts": 8, "moe_layers": [1, 2]})
    for _ in range(2):
        fetch(store, 1, [0, 5])
        fetch(store, 2, [3])
    t = store.trace.trace
    assert [(s, l, list(e)) for s, l, e in t.events()] == [(0, 1, [0, 5]), (0, 2, [3]), (1, 1, [0, 5]), (1, 2, [3])]
    assert t.expert_counts() == [[], [2, 0, 0, 0, 0, 2, 0, 0], [0, 0, 0, 2, 0, 0, 0, 0]]


def wait_idle(store, timeout=5.0):
    """Waits for the background reads, then lets the store take them in, as its next fetch would."""
    t0 = time.time()
    while any(not l.pending.ready() for l in list(store._inflight.values()) if l.pending) and time.time() - t0 < timeout:
        time.sleep(0.005)
    with store._lock:
        store._harvest()


def test_prefetch_loads_hinted_experts_and_scores_the_guess():
    store, source = make_store(slots=8)
    store.prefetcher = Prefetcher(store)
    try:
        store.prefetcher.hint(2, [4, 5, 6])
        wait_idle(store)
        assert {Key(2, 4), Key(2, 5), Key(2, 6)} <= set(store.fast.keys())
        fetch(store, 2, [4, 5, 7])  # two right, one wrong, one missed
        s = store.stats
        assert s.prefetch.precision == pytest.approx(2 / 3) and s.prefetch.recall == pytest.approx(2 / 3)
        assert s.prefetch.used == 2 and s.hits == 2
        assert s.summary().count("prefetch precision 67% recall 67%") == 1
    finally:
        store.close()


def test_prefetch_accuracy_is_undefined_without_hints():
    """Loads without a lookahead hint (in-layer read-ahead only): precision and recall have nothing to
    count; None (JSON null), and the summary says n/a."""
    s = StoreStats({"fast": TierStats()})
    s.prefetch.loaded = 3
    assert s.prefetch.precision is None and s.prefetch.recall is None
    assert s.as_dict()["prefetch"]["precision"] is None and s.as_dict()["prefetch"]["recall"] is None
    assert "prefetch precision n/a recall n/a, 3 loaded" in s.summary()


def test_prefetch_never_evicts_pinned_and_never_hangs():
    """Budget of exactly one step's experts, slow disk, hints for more than fits: demand still completes."""
    store, source = make_store(slots=2, delay=0.002)
    store.prefetcher = Prefetcher(store)
    try:
        for step in range(5):
            for layer in (1, 2, 3):
                store.prefetcher.hint(layer % 3 + 1, [0, 1, 2, 3])
                assert len(fetch(store, layer, [step % 3, 3])) == 2
                assert store.fast.used <= store.fast.capacity
        wait_idle(store)
        assert store.stats.prefetch.dropped > 0
    finally:
        store.close()


def test_demand_waits_for_an_expert_the_prefetcher_is_loading():
    store, source = make_store(slots=4, delay=0.05)
    store.prefetcher = Prefetcher(store)
    try:
        store.prefetcher.hint(1, [7])
        time.sleep(0.01)  # the background read has started
        assert fetch(store, 1, [7]) == [Key(1, 7)]
        assert source.reads == [Key(1, 7)]  # read once
        assert store.stats.prefetch.late == 1 and store.stats.stall_s > 0
    finally:
        store.close()


def test_one_policy_per_cache_tier():
    with pytest.raises(ValueError, match="one policy per cache tier"):
        ExpertStore([MemoryTier("fast", 10, cost=lambda k: 1), Source()], [LRU(), LRU()])


def test_a_newer_hint_cancels_the_older_hints_queued_reads():
    """One slow reader thread: of hint 1's four reads one starts, the other three are still queued when
    hint 2 arrives; they are dropped (reservations freed), the started one completes."""
    store, source = make_store(slots=8, delay=0.05)
    store.prefetcher = Prefetcher(store, threads=1)
    try:
        store.prefetcher.hint(1, [0, 1, 2, 3])
        queued = store.prefetcher.reads._pool._normal
        t0 = time.time()
        while len(queued) > 3 and time.time() - t0 < 5:  # until the thread has taken the first read
            time.sleep(0.001)
        store.prefetcher.hint(2, [5])
        assert set(store._inflight) == {Key(1, 0), Key(2, 5)} and store._reserved == [2 * SIZE]
        assert store.stats.prefetch.dropped == 3
        wait_idle(store)
        assert source.reads == [Key(1, 0), Key(2, 5)] and store._reserved == [0]
        assert {Key(1, 0), Key(2, 5)} <= set(store.fast.keys())
    finally:
        store.close()


def test_a_caller_that_takes_every_expert_reads_its_first_miss_itself():
    """fetch(..., takes_all=True) (the native decode step, which takes every expert before it computes): its
    first miss is a demand read on this thread, only the rest go to the reader threads (handing the first
    over too would only add a wait); the same experts, books and reads as the plain fetch."""
    got = {}
    for takes_all in (False, True):
        store, source = make_store(slots=4)
        store.prefetcher = Prefetcher(store)
        started = []
        real = store.start_background_many
        store.start_background_many = lambda keys, urgent, started=started, real=real: started.append(list(keys)) or real(keys, urgent)
        try:
            keys, wanted = [], []
            for layer, ids in ((1, [0, 1]), (2, [0, 2]), (1, [0, 3]), (1, [1, 0]), (3, [5]), (4, [0, 1, 2])):
                missing = [Key(layer, e) for e in ids if Key(layer, e) not in store.fast]
                wanted += [missing[1:] if takes_all else missing] if missing[takes_all:] else []
                keys.append([w.key for w in store.fetch(layer, ids, takes_all=takes_all)])
            s = store.stats
            got[takes_all] = (keys, s.hits, s.misses, s.tiers["fast"].evictions, sorted(store.fast.keys()),
                              sorted(source.reads))
            assert started == wanted and s.prefetch.loaded == sum(map(len, wanted))
            assert any(len(w) > 1 for w in wanted)
        finally:
            store.close()
    assert got[False] == got[True]


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_the_lookaheads_guess_is_most_chosen_first_however_it_is_counted(tokens, monkeypatch):
    """NextLayerLookahead counts a small guess in Python and a large one with torch; both hint the same
    order: most-chosen first, lower id first among equals."""
    import torch

    from moeswap.experts import prefetch

    ids_TK = torch.randint(0, 12, (tokens, 4), generator=torch.Generator().manual_seed(tokens))

    class Hints:
        def hint(self, layer, ids):
            self.got = (layer, ids)

    orders = []
    for limit in (0, 1 << 20):  # torch's unique, then Python's Counter
        monkeypatch.setattr(prefetch, "GUESSES_IN_PYTHON", limit)
        hints = Hints()
        prefetch.NextLayerLookahead({3: (4, lambda h: ids_TK)}, hints)(3, torch.zeros(tokens, 1, 8))
        orders.append(hints.got)
    flat = ids_TK.flatten().tolist()
    want = sorted(set(flat), key=lambda e: (-flat.count(e), e))
    assert orders == [(4, want), (4, want)]


def test_settle_takes_a_layers_finished_hinted_loads_in_now():
    """settle(layer) stores that layer's background loads (a hint's) whose reads are done, so a mirror table
    has them before the caller computes; a read still in flight, and another layer's loads, stay in flight."""
    store, source = make_store(slots=8, delay=0.2)
    store.prefetcher = Prefetcher(store, threads=1)
    added = []

    class Table:
        def added(self, e, w):
            added.append(e)

        def removed(self, e):
            pass

    store.mirror(2, Table())
    try:
        store.prefetcher.hint(2, [4, 5])  # one reader thread: 4 is read first, 5 waits for it
        first = store._inflight[Key(2, 4)].pending
        t0 = time.time()
        while not first.ready() and time.time() - t0 < 5:
            time.sleep(0.001)
        store.settle(3)  # nothing of layer 3 in flight
        store.settle(2)
        assert added == [4] and Key(2, 4) in store.fast and set(store._inflight) == {Key(2, 5)}
        wait_idle(store)
        assert sorted(added) == [4, 5]
        assert fetch(store, 2, [4, 5]) == [Key(2, 4), Key(2, 5)] and store.stats.prefetch.used == 2
    finally:
        store.close()


def test_copy_stats_read_events_once_they_complete():
    """StoreStats.copies (the fast tier's form on CUDA, experts/build.py): each copy's event pair is read once its
    end event has completed, never waited for; the rate is bytes over the completed copies' GPU time; the share
    beside compute is the side stream's bytes; the report is strict JSON (null before any timed copy)."""
    import json

    from moeswap.experts.stats import CopyStats

    class Event:
        def __init__(self, t: float, done: bool = True):
            self.t, self.done = t, done

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end) -> float:  # milliseconds, as torch.cuda.Event's
            return end.t - self.t

    stats = StoreStats({"fast": TierStats()})
    assert json.loads(json.dumps(stats.as_dict(), allow_nan=False))["copies"]["GBps"] is None
    c: CopyStats = stats.copies
    late = Event(30.0, done=False)
    c.record(Event(0.0), Event(2.0), 4_000_000, side=False)
    c.record(Event(10.0), late, 6_000_000, side=True)
    assert (c.copies, c.bytes, c.timed_bytes, c.copy_s) == (2, 10_000_000, 4_000_000, 0.002)
    assert c.GBps == pytest.approx(2.0) and c.overlapped == pytest.approx(0.6)
    late.done = True
    d = json.loads(json.dumps(stats.as_dict(), allow_nan=False))["copies"]
    assert d["timed_bytes"] == 10_000_000 and d["GBps"] == pytest.approx(10e6 / 0.022 / 1e9)
    assert "copied up 10.0 MB at 0.5 GB/s, 60% beside compute" in stats.summary()
