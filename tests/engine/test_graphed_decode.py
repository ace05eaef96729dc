"""engine/cuda_graph.py without a GPU: the graphed decode step run eagerly (`GraphedDecode(capture=False)`: the
forward a CUDA graph captures, with the host's work inline at each MoE routing, the Triton pair kernel under its
interpreter, the C kernels off so that every sublayer takes the torch path CUDA takes). Oracles: the model's own
forward (greedy tokens equal, logits to fp32 rounding: the step sums a token's expert outputs in slot order,
the forward in expert order), the store's books on the fetch path (LRU: the same hits, misses and evictions),
and the invariants of a mirror (each layer's device table holds exactly the fast tier's experts, at their
addresses). Capture itself is tested on CUDA (tests/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from moeswap.engine import cuda_graph
from moeswap.engine.cuda_graph import GraphedDecode
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels, triton_mxfp4

pytestmark = pytest.mark.skipif(not triton_mxfp4.interpreted(), reason="needs triton under its interpreter")


def _options(path, fraction: float, **options) -> LoadOptions:
    """LoadOptions with the fast tier at `fraction` of the model's expert bytes (1: the default, all resident)."""
    if fraction < 1:
        _, probe = load_model(path, LoadOptions())
        probe.close()
        options["expert_memory"] = int(sum(probe.fast.cost(k) for k in probe.index.entries) * fraction)
    return LoadOptions(**options)


def _decode(model, step, steps: int = 5, batch: int = 2, torch_paths: bool = False, monkeypatch=None):
    """Greedy decode from a fixed prompt: logits [steps + 1, B, V]."""
    state = model.make_state(batch)
    prompt = torch.randint(0, 400, (batch, 6), generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode():
        out = [model(prompt, state)[:, -1]]
        for _ in range(steps):
            if torch_paths:  # what CUDA runs: no C kernel inside the step
                monkeypatch.setattr(cpu_kernels, "for_inference", lambda *a, **k: None)
            out.append(step(out[-1].argmax(-1, keepdim=True), state)[:, -1])
            if torch_paths:
                monkeypatch.undo()
    return torch.stack(out)


def _check_tables(model, store) -> None:
    """(The device copy of a layer's table goes up at that layer's routing, before its kernels read it; between
    two, later layers' loads may evict from it on the host.)"""
    assert store.fast.used <= store.fast.capacity
    for moe in model.moe_blocks():
        table = moe.__dict__["_device_table"]
        held = {k.expert: store.fast.get(k) for k in store.fast.keys() if k.layer == moe.layer_idx}
        assert table.experts.keys() == held.keys()
        for e in range(moe.num_experts):
            w = held.get(e)
            if w is None:
                want = [0] * 6
            elif hasattr(w, "w1_packed"):
                want = [t.data_ptr() for t in (w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, w.w2_packed,
                                               w.w2_scale)]
            else:
                want = [w.w1_FI.data_ptr(), 0, w.w3_FI.data_ptr(), 0, w.w2_IF.data_ptr(), 0]
            assert table.host[:, :, e].T.flatten().tolist() == want, (moe.layer_idx, e)


@pytest.mark.slow
@pytest.mark.parametrize("arch,fraction,batch", [("tiny_k3_dir", 1.0, 2), ("tiny_k3_dir", 0.25, 2),
                                                 ("tiny_k3_dir", 0.25, 8), ("tiny_linear_dir", 1.0, 2),
                                                 ("tiny_linear_dir", 0.25, 2)])
def test_graphed_step_gives_the_forwards_tokens(arch, fraction, batch, request, monkeypatch):
    """K3 (MXFP4 experts, MLA + KDA, AttnRes) and Kimi Linear (float experts): all resident (one segment,
    the store filled at the first step) and at a quarter of the expert bytes (a segment per MoE layer, the
    store loading and evicting at each routing); 2 sequences (a row per pair: pair_linears) and 8 (32 pairs
    on 16 experts: sorted by expert on the device, sorted_linears): the forward's greedy tokens, logits within
    fp32 rounding."""
    path = request.getfixturevalue(arch)
    model, store = load_model(path, _options(path, fraction, expert_policy="lru"))
    E, K = model.config.moe.num_experts, model.config.moe.top_k
    assert (batch * K >= cuda_graph.GROUPED_PAIRS_PER_EXPERT * E) == (batch == 8)
    try:
        steps = 5 if batch == 2 else 2  # (the interpreter runs every program of the sorted grid: slow)
        want = _decode(model, model, steps=steps, batch=batch)
        step = GraphedDecode(model, capture=False)
        got = _decode(model, step, steps=steps, batch=batch, torch_paths=True, monkeypatch=monkeypatch)
        assert step.reason is None
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert store.can_evict == (fraction < 1)
        if fraction == 1:
            assert all(t.full() for t in step.tables.values())  # every expert resident: one graph
        else:
            assert store.stats.fast.evictions > 0
        _check_tables(model, store)
    finally:
        store.close()


@pytest.mark.slow
def test_segments_keep_the_fetch_paths_books(tiny_k3_dir, monkeypatch):
    """At a quarter with LRU, the graphed step's loads at each routing are the store's own fetches: hits, misses,
    evictions and the experts left in the tier equal the model's forward's, step for step."""
    books = []
    for graphed in (False, True):
        model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, 0.25, expert_policy="lru"))
        try:
            _decode(model, GraphedDecode(model, capture=False) if graphed else model, torch_paths=graphed,
                    monkeypatch=monkeypatch)
        finally:
            store.close()
        s = store.stats
        books.append((s.hits, s.misses, s.fast.evictions, s.disk_reads, sorted(store.fast.keys())))
    assert books[0] == books[1] and books[0][2] > 0


def test_a_tier_smaller_than_a_layer_step_is_named(tiny_k3_dir, monkeypatch):
    """A fast tier that cannot hold one layer step's experts at once: the graphed step stops with an error
    that says so and what to give, not a kernel reading an evicted expert. (The least budget a store takes is one
    token's top-k experts; two sequences route to more.)"""
    probe_model, probe = load_model(tiny_k3_dir, LoadOptions())
    probe.close()
    least = probe.fast.cost(next(iter(probe.index.entries))) * probe_model.config.moe.top_k
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=least, expert_policy="lru"))
    try:
        with pytest.raises(RuntimeError, match=r"not resident for the graphed step .* give more --expert-memory"):
            _decode(model, GraphedDecode(model, capture=False), steps=1, torch_paths=True, monkeypatch=monkeypatch)
    finally:
        store.close()


def test_steps_it_cannot_graph_take_the_forward_and_say_why(tiny_k3_dir, monkeypatch):
    """Capture without a CUDA device and a store recording a routing trace each leave the step to the model's
    forward, with the reason; the tokens are the forward's."""
    class Recorder:  # what a store recording a routing trace calls (experts/trace.py)
        def record(self, layer, ids):
            pass

    for capture, trace, why in [(True, False, "CUDA graphs need a CUDA device"), (False, True, "records a trace")]:
        model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, 0.5))
        store.trace = Recorder() if trace else None
        try:
            step = GraphedDecode(model, capture=capture)
            got = _decode(model, step, steps=2)
            assert why in step.reason
            assert torch.equal(got, _decode(model, model, steps=2))
        finally:
            store.close()


HOST_READS = ("item", "_local_scalar_dense", "is_nonzero", "nonzero", "unique", "masked_select", "equal", "allclose",
              "repeat_interleave")


def test_the_captured_forward_reads_no_tensor_on_the_host(tiny_k3_dir, monkeypatch):
    """What a CUDA graph captures must not read a tensor's data on the host (a capture fails on the sync, and
    a replay would not redo the read). The step's forward as captured (mode "capture" without a GPU: the
    segment boundaries only note where the host will read) calls no op that does, nor .tolist()."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if any(r in name for r in HOST_READS):
                self.seen.append(name)
            return func(*args, **(kwargs or {}))

    def refuse(*_):
        raise AssertionError("tolist() inside the captured forward")

    for fraction in (1.0, 0.25):
        model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, fraction))
        try:
            step = GraphedDecode(model, capture=False)
            state = model.make_state(2)
            tokens = torch.tensor([[3], [5]])
            with torch.inference_mode():
                model(torch.tensor([[1, 2], [3, 4]]), state)
                assert step.unsupported(tokens, state) is None
                step._experts.mode, step._experts.split = "warmup", fraction < 1
                monkeypatch.setattr(cpu_kernels, "for_inference", lambda *a, **k: None)
                monkeypatch.setattr(torch.Tensor, "tolist", refuse)
                with Reads() as reads:
                    logits = step._forward(tokens, state)
                monkeypatch.undo()
            assert reads.seen == [] and logits.shape[:2] == (2, 1)
        finally:
            store.close()


@pytest.mark.slow
def test_next_layer_prefetch_guesses_inside_the_step(tiny_k3_dir, monkeypatch):
    """--prefetch next-layer with the step in segments: the next MoE layer's router runs inside the segment and
    the host hints its guess at the routing stop, so the reader threads load it while later segments compute;
    the forward's tokens, and the guesses scored and used as the eager lookahead's are."""
    model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, 0.25, prefetch="next-layer"))
    try:
        want = _decode(model, model)
        before = store.stats.prefetch.predicted
        step = GraphedDecode(model, capture=False)
        got = _decode(model, step, torch_paths=True, monkeypatch=monkeypatch)
        assert step.reason is None and model.expert_lookahead is step.lookahead  # put back after each step
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        p = store.stats.prefetch
        assert p.predicted > before and p.correct > 0 and p.loaded > 0 and p.used > 0
        _check_tables(model, store)
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cpu", "auto"])
def test_hybrid_experts_inside_graphed_steps(tiny_k3_dir, mode, monkeypatch):
    """--expert-compute cpu|auto at a quarter: at each routing stop the experts the fast tier lacks are read into
    host memory and computed by the CPU's kernels, their sum handed to the next segment (the pair kernel gives
    zero for them); the forward's tokens, CPU experts counted, and a cpu store that never evicts."""
    model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, 0.25, expert_compute=mode, host_memory=1 << 20))
    try:
        want = _decode(model, model)
        before = store.stats.hybrid.cpu_experts
        step = GraphedDecode(model, capture=False)
        got = _decode(model, step, torch_paths=True, monkeypatch=monkeypatch)
        assert step.reason is None
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert store.stats.hybrid.cpu_experts > before and store.stats.fast.evictions == 0
        _check_tables(model, store)
    finally:
        store.close()


class _FakeGraph:
    """torch.cuda.CUDAGraph's calls, logged (the forward under a fake capture runs eagerly on the CPU)."""

    log: list = []

    def capture_begin(self, pool=None):
        self.log.append(("begin", id(self)))

    def capture_end(self):
        self.log.append(("end", id(self)))

    def replay(self):
        self.log.append(("replay", id(self)))


def _fake_cuda(monkeypatch):
    """Enough of torch.cuda for GraphedDecode._capture's calls on the CPU: streams, pools, graphs, syncs."""
    from contextlib import nullcontext

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    _FakeGraph.log = []


class _CaptureOnCPU(GraphedDecode):
    """GraphedDecode in capture mode whose device checks are those of capture=False (the CPU)."""

    def unsupported(self, tokens_BT, state):
        self.capture = False
        try:
            return super().unsupported(tokens_BT, state)
        finally:
            self.capture = True


@pytest.mark.parametrize("fraction,hybrid", [(1.0, False), (0.25, False), (0.25, True)])
def test_capture_and_replay_orchestration(tiny_k3_dir, fraction, hybrid, monkeypatch):
    """The graph orchestration with torch.cuda's calls faked (no kernel runs in a fake replay, so only the order is
    checked): a batch size's first step warms up and captures once (all resident: one graph; a quarter: a
    segment per MoE layer, each ended at its routing, in layer order; with hybrid experts a second stop per
    layer, after its resident experts' kernels, for the CPU's); every step replays the segments in order with
    the store's loads between them at each routing stop; a new batch size captures again, the same one does
    not, and forget_state (the scheduler's buffers moved) drops them."""
    _fake_cuda(monkeypatch)
    options = {"expert_compute": "cpu", "host_memory": 1 << 20} if hybrid else {}
    model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, fraction, **options))
    try:
        step = _CaptureOnCPU(model, capture=True)
        loads = []
        real_load = step._load
        monkeypatch.setattr(step, "_load", lambda stop: loads.append(stop.moe.layer_idx) or real_load(stop))
        moe_layers = [m.layer_idx for m in model.moe_blocks()]
        split = fraction < 1
        with torch.inference_mode():
            state2, state3 = model.make_state(2), model.make_state(3)
            model(torch.tensor([[1, 2], [3, 4]]), state2)
            model(torch.tensor([[1, 2], [3, 4], [5, 6]]), state3)
            for n, state in ((2, state2), (2, state2), (3, state3)):
                _FakeGraph.log.clear()
                loads.clear()
                before = step.captures
                step(torch.arange(n)[:, None], state)
                assert step.reason is None
                cap = step._sets[n]
                graphs = [id(g) for g in cap.graphs]
                stops = [l for l in moe_layers for _ in range(2 if hybrid else 1)] if split else []
                assert len(graphs) == len(stops) + 1
                assert [getattr(s, "stop", s).moe.layer_idx for s in cap.stops] == stops
                replays = [e for e in _FakeGraph.log if e[0] == "replay"]
                assert replays == [("replay", g) for g in graphs]  # each segment once, in capture order
                assert loads == (moe_layers if split else [])  # the host's work at each stop, in order
                captured = [e for e in _FakeGraph.log if e[0] != "replay"]
                if step.captures > before:
                    assert captured == [(kind, g) for g in graphs for kind in ("begin", "end")]
                else:
                    assert captured == []
        assert step.captures == 2 and set(step._sets) == {2, 3} and step.capture_s > 0
        assert all(t.full() for t in step.tables.values()) == (not split)
        step.forget_state()
        assert not step._sets
    finally:
        store.close()


def test_the_step_runs_the_experts_through_its_own_executor_and_gives_the_blocks_theirs_back(tiny_k3_dir,
                                                                                             monkeypatch):
    """The graphed step's forward runs each MoE block's experts through a GraphTableExecutor (named
    cuda-graph-table) installed for that forward only: the blocks' own executors are back after it."""
    model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, 1.0))
    try:
        ran = []
        real = cuda_graph.GraphTableExecutor.__call__
        monkeypatch.setattr(cuda_graph.GraphTableExecutor, "__call__",
                            lambda self, *a: ran.append((self.moe.layer_idx, self.moe.executor.name)) or real(self, *a))
        own = [moe.executor for moe in model.moe_blocks()]
        _decode(model, GraphedDecode(model, capture=False), steps=1, torch_paths=True, monkeypatch=monkeypatch)
        assert ran == [(moe.layer_idx, "cuda-graph-table") for moe in model.moe_blocks()]
        assert [moe.executor for moe in model.moe_blocks()] == own and own[0].name == "resident-table"
    finally:
        store.close()


def test_blocks_whose_executor_is_not_the_kernels_are_not_graphed(tiny_k3_dir):
    """The device table stands in for the inference kernels only: a block running an attached expert LoRA (or
    trainable experts, or expert parallelism) leaves the step to the model's forward, naming its executor."""
    model, store = load_model(tiny_k3_dir, _options(tiny_k3_dir, 1.0))
    try:
        model.moe_blocks()[2].attach_expert_lora(4, 8.0)
        step = GraphedDecode(model, capture=False)
        with torch.inference_mode():
            why = step.unsupported(torch.tensor([[3]]), model.make_state(1))
        assert why == (
            f"layer {model.moe_blocks()[2].layer_idx}: its experts carry adapters, train or are split across ranks "
            f"(executor torch-autograd)")
    finally:
        store.close()
