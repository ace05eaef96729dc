"""CUDA-graph decode steps (issue #21): a decode step captured once per batch size and replayed, so that a
step costs a few graph launches instead of hundreds of kernel launches from Python.

What makes the model's own forward capturable: the MLA caches attend over their whole buffer, masked by
their device lengths, and write at those lengths (`MLACache.whole`); KDA, AttnRes and the router run their
torch paths (no host reads); and each MoE block's routed experts go through `StepExperts` (the block's
executor for the step's forward: `GraphTableExecutor`, named cuda-graph-table), which looks each
(token, expert) pair's bytes up in a table of addresses on the device (`DeviceTable`, one per layer, kept by
the expert store as it loads and evicts: ExpertStore.mirror) in one Triton launch for gate and up and one for
down (ops/triton_mxfp4.py: `pair_linears` a row per pair; `sorted_linears` where pairs share experts, sorted
and counted on the device). The expert lookup thus stays outside the graph:
- where the store cannot evict (the fast tier holds every expert; it is filled at the first step) the whole
  step is one graph;
- where it can (a budget below the experts), the step is captured in segments that end at each MoE layer's
  routing: between two replays the host reads that layer's routed ids, the store loads what is missing
  (evicting by its policy, with its books) and the table is copied up; then the next segment replays. With
  --prefetch next-layer the next MoE layer's router runs on the device inside the segment (the lookahead's
  guess) and the host hints its ids at the same stop, so the reader threads and the side stream load them
  while the following segments compute. With hybrid experts (--expert-compute cpu|auto) the experts the fast
  tier lacks are computed on the CPU at a second stop, after the resident experts' kernels are queued (the
  two overlap), and the next segment adds their sum.
The captured forward is the model's forward: no second copy of the architecture (with EngineConfig.compile,
its attention sublayers compiled by torch.compile, engine/compile.py, whose fused kernels the graphs
capture). Sampling, the finite check and the scheduler stay outside. A step that does not fit (see
`GraphedDecode.unsupported`) runs the eager model and says why in `reason`, as the CPU's native step does.

`GraphedDecode(model, capture=False)` runs the same step eagerly, with the host's work inline at each
routing: on the CPU (the Triton kernel under its interpreter) that is what the tests check against the
eager model, since nothing here can capture without a GPU.
Shapes: B batch rows, K top-k, P = B K pairs, E experts, I expert input width, F expert width.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import nullcontext

import torch

from moeswap.experts.executors import ExpertExecutor, KernelExecutor, OnHost
from moeswap.experts.hybrid import fetch_step
from moeswap.experts.keys import Key
from moeswap.experts.pairs import pairs_by_expert
from moeswap.models.decoder import ModelState
from moeswap.models.layers.kda import KDAState
from moeswap.models.layers.mla import MLACache
from moeswap.ops import triton_mxfp4
from moeswap.ops.activation import glu
from moeswap.ops.expert import MXFP4ExpertWeights
from moeswap.weights import registry

GRAPH_SETS = 8  # batch sizes whose captured steps are kept (each holds its own memory pool)


class DeviceTable:
    """One MoE layer's experts in the store's fast tier as addresses on the device, [2, 3, E] int64: for gate
    (w1), up (w3) and down (w2), the packed bytes' and the scale bytes' addresses for MXFP4, or the matrix's
    and 0 for bf16/fp32 experts; zeros where the expert is not resident. The store keeps it told
    (ExpertStore.mirror: added, loaded, removed, under its lock); the host copy is copied up (`upload`)
    before a replay reads it. One kind of expert per table; an expert of another kind, or not laid out for
    the kernel, is not entered and `unfit` says why."""

    def __init__(self, store, num_experts: int, device: torch.device):
        self.store = store
        self.host = torch.zeros(2, 3, num_experts, dtype=torch.int64)
        self.device = torch.zeros(2, 3, num_experts, dtype=torch.int64, device=device)
        self.experts: dict[int, object] = {}  # what the rows point into, kept alive with them
        self.weights = None  # "mxfp4", torch.bfloat16 or torch.float32: pair_linears' kind
        self.unfit: str | None = None
        self.dirty = True

    def added(self, e: int, w) -> None:
        got = self._row(w)
        if got is None:
            return
        self.weights, row = got
        self.host[:, :, e] = torch.tensor(row, dtype=torch.int64).view(3, 2).T
        self.experts[e] = w
        self.dirty = True

    def loaded(self, e: int, w, row) -> None:  # the CPU's in-call loads' hook (its row is a CPU kernel's)
        self.added(e, w)

    def removed(self, e: int) -> None:
        if self.experts.pop(e, None) is not None:
            self.host[:, :, e] = 0
            self.dirty = True

    def learn_kind(self, w) -> None:
        """The table's kind from expert w without entering it (the kernels' kind is fixed when a step is captured,
        which may be before the layer has a resident expert)."""
        got = self._row(w)
        self.weights = got[0] if got is not None else None

    def full(self) -> bool:
        return len(self.experts) == self.host.shape[2]

    def upload(self) -> None:
        if self.dirty:
            self.device.copy_(self.host)
            self.dirty = False

    def _row(self, w) -> tuple[object, list[int]] | None:
        if isinstance(w, MXFP4ExpertWeights):
            mats = [w.w1_packed, w.w1_scale, w.w3_packed, w.w3_scale, w.w2_packed, w.w2_scale]
            kind = "mxfp4"
        elif hasattr(w, "w1_FI") and w.w1_FI.dtype in (torch.bfloat16, torch.float32):
            mats = [w.w1_FI, None, w.w3_FI, None, w.w2_IF, None]
            kind = w.w1_FI.dtype
        else:
            fmt = registry.BY_FORM.get(type(w))
            self.unfit = f"experts of format {fmt.name if fmt is not None else type(w).__name__}"
            return None
        if self.weights not in (None, kind):
            self.unfit = f"experts of two kinds in one layer ({self.weights} and {kind})"
            return None
        if any(t is not None and (not t.is_contiguous() or t.device != self.device.device) for t in mats):
            self.unfit = f"an expert not contiguous on {self.device.device}"
            return None
        return kind, [0 if t is None else t.data_ptr() for t in mats]


class GraphTableExecutor(ExpertExecutor):
    """A MoE block's expert executor while a graphed decode step runs its forward (installed by
    `GraphedDecode._forward`, the block's own one restored after): its routed experts through StepExperts."""

    name = "cuda-graph-table"

    def __init__(self, steps: StepExperts, moe):
        self.steps, self.moe = steps, moe

    def __call__(self, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        return self.steps(self.moe, h_TI, ids_TK, w_TK)

    def in_torch(self, h_TI, w_TK) -> bool:
        return False


class StepExperts:
    """The routed experts of a MoE block through its DeviceTable (GraphTableExecutor's work while a graphed
    step runs its forward), and what happens at each layer's routing: `mode` "capture" ends the segment being
    captured and begins the next, "eager" does the host's work now, "warmup" nothing (a throwaway step)."""

    def __init__(self, decode: GraphedDecode):
        self.decode = decode
        self.mode = "eager"
        self.split = True  # whether steps stop at each routing (a store that may evict)
        self.guesses: list[tuple[int, torch.Tensor]] = []  # next-layer guesses made since the last routing

    def guess(self, layer: int, hidden: torch.Tensor) -> None:
        """`model.expert_lookahead` while the step's forward runs: the next MoE layer's router on this hidden
        state, on the device; the host hints its ids at the next routing (`GraphedDecode._load`)."""
        lookahead = self.decode.lookahead
        route = lookahead.routes.get(layer) if self.split else None
        if route is not None and self.mode != "warmup":
            self.guesses.append((layer, route[1](hidden.reshape(-1, hidden.shape[-1]))))

    def __call__(self, moe, h_TI: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        hybrid = self.split and moe.store.hybrid is not None
        stop = None
        if self.split:
            # hybrid experts: the CPU's sum for the experts the fast tier lacks lands here between two replays
            host_TI = torch.zeros(h_TI.shape, dtype=torch.float32, device=h_TI.device) if hybrid else None
            stop = _Stop(moe, ids_TK, w_TK, h_TI, host_TI, self.guesses)
            self.guesses = []
            self._stop(stop)
        table = self.decode.tables[moe.layer_idx]
        T, K = ids_TK.shape
        x_PI = h_TI[:, None].expand(T, K, h_TI.shape[-1]).reshape(T * K, -1)  # pair p is token p // K
        y_PI = _experts(moe, table, x_PI, ids_TK.reshape(-1), T, hybrid)
        # each token's K outputs weighted and summed in slot order, in fp32
        out_TI = (y_PI.float().view(T, K, -1) * w_TK.float()[..., None]).sum(1)
        if hybrid:
            # a second stop after the resident experts' kernels are queued: the CPU computes its experts while the
            # GPU runs those, and its sum is copied up behind them
            self._stop(_HostSum(stop))
            out_TI = out_TI + stop.host_TI
        return out_TI.to(h_TI.dtype)

    def _stop(self, stop) -> None:
        if self.mode == "capture":
            self.decode._next_segment(stop)
        elif self.mode == "eager":
            stop.run(self.decode)


GROUPED_PAIRS_PER_EXPERT = 2  # from this many (token, expert) pairs per expert on average, sort and group them


def _experts(moe, table: DeviceTable, x_PI: torch.Tensor, experts_P: torch.Tensor, T: int, absent_zero: bool,
             ) -> torch.Tensor:
    """Each pair's expert output [P, I] through the layer's device table, all on the device: one row per
    program (`pair_linears`) where pairs rarely share an expert; else the pairs sorted by expert and each
    expert's weights read once for its rows (`sorted_linears`, MXFP4; offsets counted on the device)."""
    F, I = moe.expert_shapes["w1"]
    E, P = moe.num_experts, experts_P.shape[0]
    packed, scale = table.device[0], table.device[1]
    if table.weights != "mxfp4" or P < GROUPED_PAIRS_PER_EXPERT * E:
        gate_up = triton_mxfp4.pair_linears(x_PI, experts_P, packed[0:2], scale[0:2], F, table.weights, absent_zero)
        act_PF = glu(moe.act, gate_up[0], gate_up[1], moe.situ_betas)
        return triton_mxfp4.pair_linears(act_PF, experts_P, packed[2:3], scale[2:3], I, table.weights,
                                         absent_zero)[0]
    order_P = experts_P.argsort(stable=True)
    counts_E = torch.zeros(E, dtype=torch.int32, device=x_PI.device).scatter_add_(
        0, experts_P, torch.ones_like(experts_P, dtype=torch.int32))
    offsets_E1 = torch.cat([counts_E.new_zeros(1), counts_E.cumsum(0, dtype=torch.int32)])
    gate_up = triton_mxfp4.sorted_linears(x_PI.index_select(0, order_P), offsets_E1, packed[0:2], scale[0:2], F, T,
                                          absent_zero)
    act_PF = glu(moe.act, gate_up[0], gate_up[1], moe.situ_betas)
    y_sorted = triton_mxfp4.sorted_linears(act_PF, offsets_E1, packed[2:3], scale[2:3], I, T, absent_zero)[0]
    return torch.empty_like(y_sorted).index_copy_(0, order_P, y_sorted)


class _Stop:
    """Where a segmented step stops for the host: a MoE layer's routing. What the host reads then (the routed
    ids; with hybrid experts the weights and the experts' input too) and writes (`host_TI`: the CPU's sum for
    the experts the fast tier lacks), and the next-layer guesses made since the previous stop. Kept with the
    captured step: their memory is not handed to a later segment."""

    __slots__ = ("moe", "ids_TK", "w_TK", "h_TI", "host_TI", "guesses", "cpu")

    def __init__(self, moe, ids_TK, w_TK, h_TI, host_TI, guesses):
        self.moe, self.ids_TK, self.w_TK, self.h_TI, self.host_TI = moe, ids_TK, w_TK, h_TI, host_TI
        self.guesses = guesses
        self.cpu = None  # this step's experts for the CPU and their inputs on the host (`GraphedDecode._load`)

    def run(self, decode: GraphedDecode) -> None:
        decode._load(self)


class _HostSum:
    """The second stop of a hybrid layer step, after its resident experts' kernels: the CPU's experts computed
    (`_Stop.cpu`, chosen at the first stop) and their sum written into the segment's `host_TI`."""

    __slots__ = ("stop",)

    def __init__(self, stop: _Stop):
        self.stop = stop

    def run(self, decode: GraphedDecode) -> None:
        GraphedDecode._on_host(self.stop)


class _Captured:
    """One batch size's captured step: its segments (one graph, or one more than the MoE layers), where they
    end (`_Stop`s), the static token input and logits output, the state it was captured on."""

    def __init__(self, state: ModelState, tokens_B1: torch.Tensor, split: bool):
        self.state, self.tokens_B1, self.split = state, tokens_B1, split
        self.graphs: list = []
        self.stops: list = []  # where the segments end (_Stop, _HostSum)
        self.logits = None


class GraphedDecode:
    """model(tokens_B1, state) for decode steps, replayed from CUDA graphs where it applies (`reason` None),
    else the model's forward (`reason` says why)."""

    def __init__(self, model, capture: bool = True, compiled=None):
        self.model = model
        self.capture = capture
        self.compiled = compiled  # engine/compile.py CompiledDecode: its attention sublayers inside the graphs
        self.reason: str | None = None
        self.tables: dict[int, DeviceTable] = {}
        self._sets: OrderedDict[int, _Captured] = OrderedDict()
        self._experts = StepExperts(self)
        self.lookahead = None  # the model's next-layer lookahead (NextLayerLookahead), if it prefetches
        self.captures, self.capture_s = 0, 0.0  # graphs captured (warm-up included) and the time it took
        self._pool = None
        self._capturing: _Captured | None = None
        self._graph = None  # the segment being captured

    # -- the step -----------------------------------------------------------------------------------
    def __call__(self, tokens_BT: torch.Tensor, state: ModelState | None, last_only: bool = False) -> torch.Tensor:
        why = self.unsupported(tokens_BT, state)
        self.reason = why
        if why is not None:
            return self.model(tokens_BT, state, last_only)
        split = any(t.store.can_evict for t in self.tables.values())
        if not self.capture:
            return self._eager(tokens_BT, state, split)
        n = tokens_BT.shape[0]
        cap = self._sets.get(n)
        if cap is None or cap.state is not state or cap.split != split:
            cap = self._capture(tokens_BT, state, split)
        self._sets.move_to_end(n)
        cap.tokens_B1.copy_(tokens_BT)
        for i, graph in enumerate(cap.graphs):
            graph.replay()
            if i < len(cap.stops):
                cap.stops[i].run(self)
        return cap.logits

    def forget_state(self) -> None:
        """Drop the captured steps: their state buffers were reallocated (engine/state.py SlotStates)."""
        self._sets.clear()

    def unsupported(self, tokens_BT: torch.Tensor, state: ModelState | None) -> str | None:
        """Why this step cannot be graphed, or None (the device tables are made and filled on the way)."""
        m = self.model
        device = m.model.embed_tokens.weight.device
        if state is None or tokens_BT.ndim != 2 or tokens_BT.shape[1] != 1:
            return "not a decode step with state"
        if self.capture and (device.type != "cuda" or not triton_mxfp4.available()):
            return "CUDA graphs need a CUDA device and triton"
        if torch.is_grad_enabled() and any(p.requires_grad for p in m.parameters()):
            return "gradients are enabled"
        rows = getattr(m, "adapter_rows", None)
        if rows is not None:
            return "the model serves LoRA adapters"
        self.lookahead = m.expert_lookahead
        if self.lookahead is not None and not hasattr(self.lookahead, "routes"):
            return "an expert lookahead other than next-layer prefetch's"
        for moe in m.moe_blocks():
            why = self._table_for(moe, device)
            if why is not None:
                return f"layer {moe.layer_idx}: {why}"
        return None

    def _table_for(self, moe, device: torch.device) -> str | None:
        if not isinstance(moe.executor, KernelExecutor):  # the table stands in for the inference kernels only
            return f"its experts carry adapters, train or are split across ranks (executor {moe.executor.name})"
        s = moe.store
        if not hasattr(s, "mirror") or s.fast.device != device:
            return f"its expert store's fast tier is not on {device}"
        if s.trace is not None:
            return "its expert store records a trace"
        table = moe.__dict__.get("_device_table")
        if table is None or table.store is not s:
            table = moe.__dict__["_device_table"] = DeviceTable(s, moe.num_experts, device)
            s.mirror(moe.layer_idx, table)
        if not s.can_evict and not table.full():  # all resident: fill it now, so that the step is one graph
            s.preload([(moe.layer_idx, e) for e in range(moe.num_experts)], reset_stats=False)
        elif table.weights is None and table.unfit is None:  # an expert in the fast tier's form, read beside the
            # store (its books and budget are not the table's)
            table.learn_kind(s.fast.form(s.source.get(Key(moe.layer_idx, 0))))
        if table.unfit is not None:
            return table.unfit
        self.tables[moe.layer_idx] = table
        return None

    # -- eager, capture, and the host's work between segments ----------------------------------------
    def _forward(self, tokens_BT: torch.Tensor, state: ModelState) -> torch.Tensor:
        """The model's forward on `state` with its MLA caches in whole-buffer mode and the experts through the
        device tables (the same buffers: the model's in-place updates land in the caller's state)."""
        whole = ModelState([MLACache(st.latent_BSX, st.lengths_B, whole=True) if isinstance(st, MLACache) else st
                            for st in state.layers])
        blocks = self.model.moe_blocks()
        own = [moe.executor for moe in blocks]
        for moe in blocks:
            moe.executor = GraphTableExecutor(self._experts, moe)
        if self.lookahead is not None:
            self.model.expert_lookahead = self._experts.guess
        self._experts.guesses = []
        try:
            with self.compiled.swapped() if self.compiled is not None else nullcontext():
                return self.model(tokens_BT, whole)
        finally:
            for moe, executor in zip(blocks, own, strict=True):
                moe.executor = executor
            self.model.expert_lookahead = self.lookahead

    def _eager(self, tokens_BT: torch.Tensor, state: ModelState, split: bool) -> torch.Tensor:
        self._experts.mode, self._experts.split = "eager", split
        for table in self.tables.values():
            table.upload()
        return self._forward(tokens_BT, state)

    def _load(self, stop: _Stop) -> None:
        """At a layer's routing: the guesses made since the last one are hinted (with --prefetch next-layer: the
        reader threads load them and copy them up on the side stream while the next segments compute), the
        store makes the routed experts resident (its fetch: hits, misses, the policy's evictions; the step's
        experts are pinned; a prefetched one's copy is waited for on the stream) and the table goes up. With
        hybrid experts (experts/hybrid.py) those the fast tier lacks are read into host memory instead and
        computed by the CPU's kernels (experts/executors.py OnHost), their weighted sum copied into `stop.host_TI`."""
        for at, guess_TK in stop.guesses:
            self.lookahead.guessed(at, guess_TK)
        layer = stop.moe.layer_idx
        ids = sorted(set(stop.ids_TK.flatten().tolist()))  # the host's one read of the layer step
        table = self.tables[layer]
        fetched = fetch_step(table.store, layer, ids, stop.ids_TK.shape[0])
        on_host = getattr(fetched, "host", None) or [False] * len(ids)
        cpu = {}
        for i in range(len(fetched)):
            w = fetched[i]
            if on_host[i]:
                cpu[ids[i]] = w
        # their inputs come down now, while the stream is idle (at the _HostSum stop it runs the resident experts)
        stop.cpu = (cpu, stop.h_TI.float().cpu(), stop.ids_TK.cpu(), stop.w_TK.float().cpu()) if cpu else None
        missing = [e for e in ids if e not in table.experts and e not in cpu]
        if missing:
            raise RuntimeError(f"layer {layer}: experts {missing[:8]} are not resident for the graphed step (the "
                               f"fast tier is smaller than one layer step's experts): give more --expert-memory")
        table.upload()

    @staticmethod
    def _on_host(stop: _Stop) -> None:
        """The step's pairs routed to the experts `_load` read into host memory computed on the CPU, as an eager
        hybrid step computes them, and their weighted sum written into the segment's `host_TI` (zero without)."""
        stop.host_TI.zero_()
        if stop.cpu is None:
            return
        experts, h_TI, ids_TK, w_TK = stop.cpu
        stop.cpu = None
        unique, counts, token_of, weights = pairs_by_expert(ids_TK, w_TK)
        run = OnHost(h_TI, token_of, weights, stop.moe)
        start = 0
        for e, n in zip(unique, counts, strict=True):
            if e in experts:
                run.group.take(experts[e], start, n)
            start += n
        run.finish(stop.host_TI)

    def _capture(self, tokens_BT: torch.Tensor, state: ModelState, split: bool) -> _Captured:
        """Warm up on a throwaway state of the same shapes (kernels compiled, kept weights derived, cuBLAS set
        up, none of it inside the capture), then capture the step on `state`'s buffers."""
        t0 = time.perf_counter()
        while len(self._sets) >= GRAPH_SETS:
            self._sets.popitem(last=False)
        n = tokens_BT.shape[0]
        cap = _Captured(state, tokens_BT.clone(), split)
        scratch = ModelState([KDAState(torch.zeros_like(st.recurrent_BHKK), torch.zeros_like(st.conv_BWC))
                              if isinstance(st, KDAState) else
                              MLACache(torch.zeros_like(st.latent_BSX), torch.zeros_like(st.lengths_B))
                              for st in state.layers])
        for table in self.tables.values():
            table.upload()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        self._experts.mode, self._experts.split = "warmup", split
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(cap.tokens_B1, scratch)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self._pool = torch.cuda.graph_pool_handle()
        self._experts.mode, self._capturing = "capture", cap
        with torch.cuda.stream(side):
            self._graph = torch.cuda.CUDAGraph()
            cap.graphs.append(self._graph)
            self._graph.capture_begin(pool=self._pool)
            try:
                cap.logits = self._forward(cap.tokens_B1, state)
            finally:
                self._graph.capture_end()
                self._graph = self._capturing = None
        torch.cuda.current_stream().wait_stream(side)
        del scratch
        assert len(cap.graphs) == len(cap.stops) + 1 and n == cap.tokens_B1.shape[0]
        self._sets[n] = cap
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return cap

    def _next_segment(self, stop) -> None:
        """At a stop during capture: end this segment's graph (the host does `stop.run` after its replays) and
        begin the next one in the same pool (replayed in capture order, which makes sharing safe)."""
        cap = self._capturing
        cap.stops.append(stop)
        self._graph.capture_end()
        self._graph = torch.cuda.CUDAGraph()
        cap.graphs.append(self._graph)
        self._graph.capture_begin(pool=self._pool)
