"""In-call expert loads (experts/incall.py, csrc/decode_step.c load_missing): the native decode step reads the
experts a layer step lacks itself instead of stopping. Oracles: the model's forward (logits bit for bit), the
same decode with in-call loads off (the store's own fetches: with LRU the same books), and the invariants of a
store (the fast tier within its budget, each layer's table exactly the experts the tier holds, each row the
pointers the kernel would take from that expert)."""

from __future__ import annotations

import pytest
import torch

from moeswap.engine.native_step import NativeDecode
from moeswap.engine.scheduler import fuse_projections
from moeswap.experts import incall
from moeswap.experts.keys import Key
from moeswap.formats.checkpoint import CheckpointError
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels, kernel_experts
from moeswap.ops.expert import tensors

pytestmark = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")


@pytest.fixture(scope="module")
def half(tiny_k3_dir) -> int:
    """Half the tiny K3's expert bytes: 40 of its 80 experts, twice what a step of one sequence routes to (a tier
    smaller than a step's experts makes the call stop: it evicts only experts it has not used itself)."""
    _, probe = load_model(tiny_k3_dir, LoadOptions())
    probe.close()
    return sum(probe.fast.cost(k) for k in probe.index.entries) // 2


def _prompts(batch: int) -> torch.Tensor:
    return torch.randint(0, 400, (batch, 6), generator=torch.Generator().manual_seed(batch))


def _books(store):
    s = store.stats
    return s.hits, s.misses, s.fast.evictions, s.disk_reads, sorted(store.fast.keys())


def _check_tables(model, store) -> None:
    """Every MoE layer's table holds exactly the tier's experts of that layer, each row as the kernel takes it,
    and every expert in the tier holds its own bytes (as the checkpoint has them: a load may have taken over an
    evicted expert's buffer and weights object)."""
    assert store.fast.used <= store.fast.capacity
    for moe in model.moe_blocks():
        table = moe.resident_table()
        held = {k.expert: store.fast.get(k) for k in store.fast.keys() if k.layer == moe.layer_idx}
        assert table.experts.keys() == held.keys() and all(table.experts[e] is w for e, w in held.items())
        for e in range(moe.num_experts):
            want = [0] * 6 if e not in held else list(kernel_experts.resident_row(held[e], table.I, table.kind)[1])
            assert table.rows[e].tolist() == want, (moe.layer_idx, e)
        for e, w in held.items():
            fresh = store.source.get(Key(moe.layer_idx, e))
            assert all(torch.equal(a, b) for a, b in zip(tensors(w).values(), tensors(fresh).values())), e


def _decode(path, budget, policy="lru", steps=8, batch=1, in_call=True, native=True, monkeypatch=None, **options):
    """Greedy decode: logits [steps + 1, B, V], the store, the model, and how many C calls ran each step."""
    if not in_call:
        monkeypatch.setattr(incall.InCallLoads, "build", classmethod(lambda cls, store, rows: None))
    model, store = load_model(path, LoadOptions(expert_memory=budget, expert_policy=policy, **options))
    fuse_projections(model)
    step = NativeDecode(model) if native else model
    calls, real = [], cpu_kernels.kernel().lib.moeswap_decode_layers
    counting = lambda *a: calls.append(1) or real(*a)
    state = model.make_state(batch)
    lib = cpu_kernels.kernel().lib
    try:
        lib.moeswap_decode_layers = counting
        with torch.inference_mode():
            outs = [model(_prompts(batch), state)[:, -1]]
            for _ in range(steps):
                outs.append(step(outs[-1].argmax(-1, keepdim=True), state)[:, -1])
    finally:
        lib.moeswap_decode_layers = real
        store.close()
        if not in_call:
            monkeypatch.undo()
    return torch.stack(outs), store, model, len(calls) / steps


def test_lru_loads_in_the_call_with_the_stores_own_books(tiny_k3_dir, half, monkeypatch):
    """At half the expert bytes the call loads what it lacks and goes on: about one call a step (it
    stopped at most MoE layers before), the forward's logits bit for bit, and with LRU the same hits, misses,
    evictions, disk reads and residents as the store's own fetches, every table exactly what the tier holds."""
    want, _, _, _ = _decode(tiny_k3_dir, half, native=False)
    got, store, model, calls = _decode(tiny_k3_dir, half)
    _, fetched, _, stopping = _decode(tiny_k3_dir, half, in_call=False, monkeypatch=monkeypatch)
    assert torch.equal(got, want)
    assert store.stats.fast.evictions > 0 and store.stats.misses > 0
    assert calls < 1.5 < stopping  # (the call stops only when it runs out of what it was offered)
    assert _books(store) == _books(fetched)
    _check_tables(model, store)


def test_a_load_takes_over_an_evicted_experts_buffer_only_when_nothing_else_holds_it(tiny_k3_dir, half,
                                                                                      monkeypatch):
    """A load reads into the buffer of a victim it evicted, reusing its weights object, where the tier and its
    table were all that held it; an expert someone else keeps (here: this test) keeps its bytes: its buffer is
    never read into."""
    reused, real = [], incall.InCallLoads.books

    def books(self, stopped):
        reused.append(sum(self.log[incall.LOG_ENTRY * j + incall.LOG.BUFFER] <= -3
                          for j in range(self.state[incall.LS.LOG])))
        return real(self, stopped)

    monkeypatch.setattr(incall.InCallLoads, "books", books)
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=half, expert_policy="lru"))
    fuse_projections(model)
    step, state = NativeDecode(model), model.make_state(1)
    with torch.inference_mode():
        tokens = model(_prompts(1), state)[:, -1:].argmax(-1)
        for _ in range(4):
            tokens = step(tokens, state)[:, -1:].argmax(-1)
        assert sum(reused) > 0  # buffers taken over while nothing else held them
        kept = {k: store.fast.get(k) for k in store.fast.keys()}
        before = {k: [t.clone() for t in tensors(w).values()] for k, w in kept.items()}
        evictions = store.stats.fast.evictions
        for _ in range(8):
            tokens = step(tokens, state)[:, -1:].argmax(-1)
    store.close()
    assert store.stats.fast.evictions > evictions and any(k not in store.fast for k in kept)
    for k, w in kept.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors(w).values(), before[k])), k
    _check_tables(model, store)


@pytest.mark.parametrize("policy", ["lfru", "lfu"])
def test_other_policies_load_in_the_call_within_the_budget(tiny_k3_dir, half, policy):
    """Policies that rank by more than recency: the call evicts from their ranking as it stood when it began
    (their books may differ from a fetch's); the logits are the forward's and the store's invariants hold."""
    want, _, _, _ = _decode(tiny_k3_dir, half, policy=policy, native=False)
    got, store, model, calls = _decode(tiny_k3_dir, half, policy=policy)
    assert torch.equal(got, want) and calls < 1.5 and store.stats.fast.evictions > 0
    _check_tables(model, store)


def test_a_call_offered_too_little_stops_and_the_store_loads_the_rest(tiny_k3_dir, half, monkeypatch):
    """One victim and one free buffer per call: the call loads what those allow, stops for the rest (the store's
    fetch, then resumes): the same logits and, with LRU, the same books as the store alone."""
    real = incall.InCallLoads.offer

    def scarce(self, B):
        real(self, B)
        self.state[incall.LS.VICTIMS] = min(1, self.state[incall.LS.VICTIMS])
        self.state[incall.LS.FREE] = min(1, self.state[incall.LS.FREE])

    _, fetched, _, _ = _decode(tiny_k3_dir, half, in_call=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(incall.InCallLoads, "offer", scarce)
    want, _, _, _ = _decode(tiny_k3_dir, half, native=False)
    got, store, model, calls = _decode(tiny_k3_dir, half)
    assert torch.equal(got, want) and calls > 1.5
    assert _books(store) == _books(fetched)
    _check_tables(model, store)


@pytest.mark.parametrize("prefetch", ["none", "next-layer"])  # next-layer: also read ahead on the reader threads
def test_a_bad_scale_byte_read_in_the_call_is_named_by_the_store(tiny_k3_dir, copy_model, half, prefetch):
    """The call checks the scale bytes it reads (the reader's check); an expert with a NaN scale byte is not
    stored: the call stops and the store's load raises the error naming the layer, the expert and the file."""
    path = copy_model(tiny_k3_dir)
    model, store = load_model(path, LoadOptions(expert_memory=half, expert_policy="lru", prefetch=prefetch))
    fuse_projections(model)
    step, state = NativeDecode(model), model.make_state(1)
    loads = []
    real = store.table_step
    store.table_step = lambda layer, ids, got, evicted=(): loads.append(len(got)) or real(layer, ids, got, evicted)
    with torch.inference_mode():
        tokens = model(_prompts(1), state)[:, -1:].argmax(-1)
        tokens = step(tokens, state)[:, -1:].argmax(-1)  # in-call loads set up (from sound bytes)
        bad = [e for e in range(model.config.moe.num_experts) if Key(1, e) not in store.fast]
        for e in bad:  # every expert of layer 1 not in the tier: whichever the call reads next is bad
            names = store.index.names(1, e)
            info = store.ckpt.info(names["w1"]["weight_scale"])
            with open(info.file, "r+b") as f:
                f.seek(info.offset)
                f.write(b"\xff")
        with pytest.raises(CheckpointError) as err:
            for _ in range(40):
                tokens = step(tokens, state)[:, -1:].argmax(-1)
    store.close()
    msg = str(err.value)
    assert any(loads) and "layer 1 expert" in msg and "NaN scale bytes" in msg and info.file.name in msg
    assert not any(Key(1, e) in store.fast for e in bad)


def test_a_store_that_keeps_nothing_reads_each_steps_experts_in_the_call(tiny_k3_dir, half, monkeypatch):
    """--expert-policy none: the call reads every routed expert into a buffer for its layer and gives it back
    (its table is empty again after each layer): the forward's logits, one call a step, and the same misses and
    disk reads as the store's own fetches, nothing kept."""
    want, _, _, _ = _decode(tiny_k3_dir, half, policy="none", native=False)
    got, store, model, calls = _decode(tiny_k3_dir, half, policy="none")
    _, fetched, _, stopping = _decode(tiny_k3_dir, half, policy="none", in_call=False, monkeypatch=monkeypatch)
    assert torch.equal(got, want) and calls < 1.5 < stopping
    assert _books(store) == _books(fetched) and store.stats.hits == 0 and len(store.fast) == 0
    assert all(not moe.resident_table().rows.any() for moe in model.moe_blocks())


def test_reads_ahead_of_the_next_layer_run_on_the_reader_threads(tiny_k3_dir, half, monkeypatch):
    """With next-layer prefetch, each MoE layer routes the next one in the call and hands the experts that guess
    lacks to the reader threads; the next layer takes them when it routes: the forward's logits, reads ahead
    counted as prefetched (loaded, used or wasted) and scored, every table and expert as the tier holds them."""
    kinds, real = [], incall.InCallLoads.books

    def books(self, stopped):
        kinds.extend(self.log[incall.LOG_ENTRY * j + incall.LOG.KIND] for j in range(self.state[incall.LS.LOG])
                     if self.log[incall.LOG_ENTRY * j + incall.LOG.BUFFER] != -1)
        return real(self, stopped)

    want, _, _, _ = _decode(tiny_k3_dir, half, native=False, prefetch="next-layer")
    monkeypatch.setattr(incall.InCallLoads, "books", books)
    got, store, model, calls = _decode(tiny_k3_dir, half, prefetch="next-layer")
    p = store.stats.prefetch
    assert torch.equal(got, want) and calls < 1.5
    assert kinds.count(incall.KIND.AHEAD) > 0 and incall.KIND.AHEAD_BAD not in kinds
    assert p.loaded >= kinds.count(incall.KIND.AHEAD) and p.used > 0 and p.predicted > 0 and p.correct > 0
    _check_tables(model, store)


@pytest.mark.parametrize("prefetch", ["none", "next-layer"])
def test_a_scheduler_batch_that_grows_and_shrinks_swaps_in_the_call(tiny_k3_dir, half, prefetch):
    """The continuous-batching scheduler's batches change size step to step (the call's offer is sized per
    batch): at half the expert bytes its tokens are those of a store that holds every expert."""
    from moeswap.engine.scheduler import EngineConfig, Request, Scheduler

    reqs = [Request(_prompts(1)[0].tolist()[:n], m) for n, m in [(5, 6), (3, 9), (2, 4), (6, 7)]]
    runs = []
    for options in (dict(expert_memory=1 << 30), dict(expert_memory=half, expert_policy="lru", prefetch=prefetch)):
        model, store = load_model(tiny_k3_dir, LoadOptions(**options))
        fuse_projections(model)
        runs.append([r.tokens for r in Scheduler(model, EngineConfig(max_batch=3, max_len=64)).run(reqs)])
        store.close()
    assert runs[0] == runs[1] and store.stats.fast.evictions > 0
    _check_tables(model, store)
