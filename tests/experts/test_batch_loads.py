"""The batched load path (a layer step's or a hint's background loads begun under one lock and submitted
to the readers in one call, `ExpertStore.batch_loads`) against the per-expert path as the oracle: the same
fetch-and-hint trace through both, on the tiny K3 checkpoint with the native reader, gives the same hits,
misses and evictions in the same order and the same counters, for every policy, with and without a host
tier; and the readers' byte checks flag exactly the bytes over the limit."""

from __future__ import annotations

import random

import pytest
import torch

from moeswap.experts.reads import Checks, Reads, native_library, read_now
from moeswap.models.loader import LoadOptions, load_model


def _trace(layers: list[int], experts: int, top_k: int, steps: int) -> list[tuple[int, list[int], list[int]]]:
    """(layer, routed ids, the lookahead's guess for the next layer) per layer step: skewed routing (a few
    hot experts), guesses right about half the time."""
    rng = random.Random(0)
    weights = [1.0 / (1 + e) for e in range(experts)]
    out = []
    for _ in range(steps):
        for layer in layers:
            ids = sorted(set(rng.choices(range(experts), weights, k=top_k)))
            guess = rng.sample(range(experts), top_k)
            out.append((layer, ids, guess))
    return out


def _settle(store) -> None:
    """Wait for every background read, so both paths see the same finished loads at the next fetch."""
    for load in list(store._inflight.values()):
        if load.pending is not None:
            load.pending.wait()


def _replay(store, trace, layers) -> tuple[list, dict]:
    """Per step: hint the next layer, fetch, use each expert in order; logs hits/misses per step and every
    eviction the fast tier's policy makes."""
    evictions = []
    victim = store.policies[0].victim

    def logged(pinned=(), aside=None):  # aside: the batched path's run of evictions with the same pins
        key = victim(pinned, aside)
        evictions.append(key)
        return key

    store.policies[0].victim = logged
    log = []
    for layer, ids, guess in trace:
        nxt = layers[(layers.index(layer) + 1) % len(layers)]
        store.prefetcher.hint(nxt, guess)
        _settle(store)
        before = (store.stats.hits, store.stats.misses)
        got = store.fetch(layer, ids)
        for i in range(len(ids)):
            w = got[i]
            assert w is not None
            del w
            _settle(store)
        log.append((layer, tuple(ids), store.stats.hits - before[0], store.stats.misses - before[1],
                    tuple(sorted(store.fast.keys()))))
        assert store.fast.used <= store.fast.capacity
    stats = store.stats.as_dict()
    for timing in ("stall_s", "load_s"):
        stats.pop(timing)
    for timing in ("busy_s", "read_GBps", "hidden"):
        stats["disk_io"].pop(timing)
    return log + [tuple(evictions)], stats


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru", "static", "belady"])
@pytest.mark.parametrize("host", [False, True], ids=["fast-only", "host-tier"])
def test_batched_loads_make_the_per_expert_paths_decisions(tiny_k3_dir, tmp_path, policy, host):
    if native_library() is None:
        pytest.skip("the native reader does not build here")
    from moeswap.experts.trace import TraceRecorder, model_meta, write_trace

    model, probe = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    layers = sorted({layer for layer, _ in probe.index.entries})
    experts = 1 + max(e for _, e in probe.index.entries)
    top_k = model.config.moe.top_k
    total = sum(probe.fast.cost(k) for k in probe.index.entries)
    trace = _trace(layers, experts, top_k, steps=6)
    # static's profile and belady's future: a trace of these very accesses
    recorder = TraceRecorder(model_meta(model, probe, str(tiny_k3_dir)))
    for layer, ids, _ in trace:
        recorder.record(layer, ids)
    path = str(write_trace(recorder.trace, tmp_path / "trace.bin"))
    probe.close()
    runs = []
    for batch in (False, True):
        opts = LoadOptions(expert_memory=total // 4, expert_policy=policy, prefetch="next-layer", expert_profile=path,
                           host_memory=total // 2 if host else 0)
        _, store = load_model(tiny_k3_dir, opts)
        store.batch_loads = batch
        try:
            runs.append(_replay(store, trace, layers))
        finally:
            store.close()
    (per_expert, stats_a), (batched, stats_b) = runs
    assert stats_a["misses"] > 0 and stats_a["tiers"]["fast"]["evictions"] > 0 and stats_a["prefetch"]["loaded"] > 0
    assert batched == per_expert
    assert stats_b == stats_a


def test_reader_checks_flag_only_bytes_over_the_limit_in_their_ranges(tmp_path):
    lib = native_library()
    if lib is None:
        pytest.skip("the native reader does not build here")
    data = bytearray(range(256)) * 4  # 1 KiB: bytes 0..255 four times
    file = tmp_path / "data.bin"
    file.write_bytes(bytes(data))
    import os

    fd = os.open(file, os.O_RDONLY)
    reads = Reads(2, native=True)
    try:
        cases = [(Checks(((0, 253),), 252), False),  # 0..252: all at the limit or below
                 (Checks(((0, 254),), 252), True),  # includes 253
                 (Checks(((0, 100), (512 + 240, 20)), 252), True),  # the second range holds bytes 240..255
                 (Checks(((256, 200), (600, 10)), 252), False),
                 (Checks((), 0), False)]
        for checks, bad in cases:
            buf = torch.empty(1024, dtype=torch.uint8)
            assert read_now(fd, 0, buf, checks) is bad, checks
            assert bytes(buf.numpy()) == bytes(data)
        pendings = reads.read_many([([(fd, 0, torch.empty(1024, dtype=torch.uint8))], lambda e, b: (e, b), c)
                                    for c, _ in cases], urgent=True)
        assert [p.result() for p in pendings] == [(None, bad) for _, bad in cases]
        with pytest.raises(ValueError, match="outside a buffer of 16 bytes"):
            read_now(fd, 0, torch.empty(16, dtype=torch.uint8), Checks(((8, 16),), 252))
        buf = torch.empty(2048, dtype=torch.uint8)  # past the end of the file
        with pytest.raises(OSError, match="file shrank"):
            read_now(fd, 0, buf, Checks(((0, 8),), 252))
        assert read_now(fd, 0, torch.empty(8, dtype=torch.uint8)) is None  # nothing to check: not checked
    finally:
        reads.close()
        os.close(fd)
