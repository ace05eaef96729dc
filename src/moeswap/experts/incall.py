"""In-call expert loads: the native decode step reads the experts a layer step lacks inside its one C call.

Without them the step stops at every layer whose chosen experts are not all in its resident table and the
store loads them (engine/native_step.py); at a small fast tier that is most layers of every token, each stop
and each load costing the model's thread Python time (docs/benchmarks.md). With them the call reads a
missing expert itself (csrc/decode_step.c `load_missing`: the reader's own read and scale-byte check,
ops/csrc/expert_read.h) into a free read buffer, writes its table row, evicts for room from victims the store
offered before the call (its policy's coldest residents, passing over any the call has routed to), and logs
what it did. After the call `books` gives the store that log (`ExpertStore.table_step`), which keeps the books
its own fetches would have kept: with LRU the same hits, misses, evictions and residents, in the same order
(tests/engine/test_incall_loads.py); other policies rank the offered victims as they stood when the call
began (one the call used is never evicted by it), where a fetch re-ranks after every access.

Applies to a store whose fast tier keeps experts on the CPU as their stored bytes (or keeps none: then the call
reads each step's experts into buffers it gives back after the layer, as the store's fetch reads them), read
straight from the checkpoint (no host tier, no trace; hybrid experts only for steps they send to the fast
tier), where each expert of a layer is one span of one file laid out like the others. The call still stops,
as before, when it runs out of offered victims, free buffers or log, or a read fails or finds a bad scale
byte (the store's own load then names the expert and the file).

A load reads into the buffer of a victim it evicted where the tier and its table were all that held that
expert (`offer` checks the references), and the store gives the victim's weights object, views of that
buffer, to the new expert: no views made, no buffer taken from or returned to the pool. With next-layer
prefetch the call also reads ahead: each MoE layer routes the next one on its own input and hands the reads
of what that guess lacks to the prefetcher's reader threads (`Reads.entry_points`); the next layer takes them
when it routes, and the store books them as prefetched experts and scores the guesses.

Entry point: `InCallLoads.build(store, rows)` (None where it does not apply), `offer(B)` before each call,
`books(...)` after it.
"""

from __future__ import annotations

import ctypes
import sys
from types import SimpleNamespace

import torch

from moeswap.experts.buffers import storage_users
from moeswap.experts.keys import Key
from moeswap.experts.reads import ReadJob, native_library, read_job, read_now
from moeswap.ops.expert import tensors
from moeswap.ops.kernel_abi import abi

_i64 = ctypes.c_int64
# the call's shared lists (csrc/cpu_kernels.h): load_state's slots, a load_victims and a load_log entry's columns,
# a log entry's kinds, each by name
_LISTS = abi().lists
LS = SimpleNamespace(**_LISTS["LOAD_STATE"])
VICTIM, LOG = SimpleNamespace(**_LISTS["LOAD_VICTIM"]), SimpleNamespace(**_LISTS["LOAD_LOG"])
KIND = SimpleNamespace(**_LISTS["LOAD_KINDS"])
VICTIM_ENTRY, LOG_ENTRY = len(_LISTS["LOAD_VICTIM"]), len(_LISTS["LOAD_LOG"])
# `offer` writes a victim's columns, and `books` reads a log entry's, in this order
if (list(_LISTS["LOAD_VICTIM"]), list(_LISTS["LOAD_LOG"])) != (["LAYER", "EXPERT", "COST", "STATE", "BUFFER"],
                                                              ["LAYER", "EXPERT", "BUFFER", "KIND"]):
    raise ImportError(f"experts/incall.py writes load entries in another column order than cpu_kernels.h: {_LISTS}")
SPARE_BYTES = 64 << 20  # free read buffers kept for the call beyond two layer steps' worth
MAX_VICTIM_LAYERS = 8
# references to an expert nothing else uses: the fast tier's and its layer's table's, and in `offer` the local
# name and getrefcount's argument (its buffer's storage then has the pool's tensor, the expert's views and
# storage_users' own: views + 2)
_SOLE_REFS = 4


def _buffer_of(w) -> tuple[torch.Tensor, int, int]:
    """(one of expert w's tensors, the users its buffer's storage has when only w's views and the pool hold it,
    the buffer's address), kept on w: a load that takes the buffer over keeps w and its views."""
    got = w.__dict__.get("_buffer_of")
    if got is None:
        held = tensors(w)
        first = next(iter(held.values()))
        # where its bytes begin in the buffer (an O_DIRECT read's buffer has room before them: reads.direct_layout)
        storage = first.untyped_storage().data_ptr()
        address = min(t.data_ptr() for t in held.values() if t.untyped_storage().data_ptr() == storage)
        got = w.__dict__["_buffer_of"] = (first, len(held) + 2, address)
    return got


class _LayerLoads:
    """What the call needs to load one layer's experts: where each one's bytes are, the read job with its
    checks, the table row's offsets into the bytes; and the span all of them are laid out like."""

    def __init__(self, at: ctypes.Array, job, row: tuple[int, ...], cost: int, span):
        self.at, self.job, self.row, self.cost, self.span = at, job, row, cost, span


class InCallLoads:
    def __init__(self, store, layers: dict[int, _LayerLoads], rows: dict, topk: int):
        self.store, self.layers, self.rows = store, layers, rows
        first = next(iter(layers.values())).span
        self.nbytes = first.end - first.start  # every load layer's (build checks)
        self.topk = topk
        self.state = (_i64 * len(_LISTS["LOAD_STATE"]))()
        self._B = 0
        self._free: list[torch.Tensor] = []  # free read buffers handed to the call, taken from the end
        self._offered: list = []  # the offered victims' weights, where a load may take over their buffer
        # a victim's weights (views of its buffer) serve any load layer's expert only when they are laid out alike
        self.reuse = len({lay.span.layout for lay in layers.values()}) == 1

    @classmethod
    def build(cls, store, rows: dict) -> InCallLoads | None:
        """For `store`'s MoE layers `rows` {layer: (its decode_layer row, its resident table)}, or None where the
        store cannot take in-call loads."""
        src = getattr(store, "source", None)
        if (not hasattr(store, "table_step") or len(store.tiers) != 2 or store.fast.device.type != "cpu"
                or not store.can_evict or store.trace is not None or not hasattr(src, "span")
                or native_library() is None):  # (the reader library checked msw_job's layout)
            return None
        layers, nbytes = {}, None
        for i, (_, table) in rows.items():
            got = cls._layer(store, i, table)
            if got is not None and (nbytes is None or got.span.end - got.span.start == nbytes):
                layers[i], nbytes = got, got.span.end - got.span.start
        if not layers:
            return None
        topk = max(rows[i][0].topk for i in layers)
        loads = cls(store, layers, {i: rows[i][0] for i in layers}, topk)
        for i, t in loads.rows.items():
            lay = layers[i]
            t.load_at, t.load_job, t.load_cost = ctypes.addressof(lay.at), ctypes.addressof(lay.job), lay.cost
            t.load_row[:] = lay.row
        return loads

    @staticmethod
    def _layer(store, layer: int, table) -> _LayerLoads | None:
        """Layer `layer`'s load description, from a read of its expert 0 (the table takes its format from it)."""
        src, E = store.source, table.rows.shape[0]
        span = src.span(Key(layer, 0))
        if span is None:
            return None
        n = span.end - span.start
        buf = src.buffers.take(n)
        fd = src.fd(span.file)
        if read_now(fd, span.start, buf, span.checks):
            return None  # a bad scale byte: the store's load will name it
        w = src.views(buf, span)
        row = table.row(w) if store.fast.form(w) is w else None
        if row is None:
            return None
        base = buf.data_ptr()
        offsets = tuple(p - base if p else -1 for p in row)
        if not all(-1 <= o < n for o in offsets):
            return None  # (a matrix outside the read bytes: a copy the table keeps)
        at = (_i64 * (2 * E))()
        for e in range(E):
            s = src.span(Key(layer, e))
            if s is None or s.layout != span.layout or s.end - s.start != n:
                return None
            at[2 * e], at[2 * e + 1] = src.fd(s.file), s.start
        # buffered reads here (one buffer layout for every expert: no room for an O_DIRECT read's alignment);
        # where the store reads by O_DIRECT they leave the page cache as those would, dropping what they read
        drop = src.drop_page_cache or getattr(src, "mode", "") == "direct"
        return _LayerLoads(at, read_job(0, 0, buf, drop, span.checks), offsets,
                           store.fast.cost(Key(layer, 0)), span)

    def clear(self) -> None:
        """Take the load fields off the rows (another store, or none, is attached now)."""
        for t in self.rows.values():
            t.load_at = t.load_job = t.load_state = t.load_buffers = t.load_victims = t.load_log = None

    def offer(self, B: int) -> None:
        """Before a call of B sequences: the store's free bytes and coldest residents, and free buffers; none
        where its hybrid experts compute a step of B tokens' missing experts on the CPU instead (they are not
        to enter the fast tier then: the call stops for them)."""
        if B != self._B:  # sized for every chosen expert of every layer missing
            self._B = B
            self.cap = B * self.topk * len(self.layers)
            self.keep = min(self.cap, max(2 * B * self.topk, SPARE_BYTES // self.nbytes))
            # victims offered: eight layer steps' worth at most (each offer walks the policy's heap: with
            # K3's 60 layers and 32 sequences every expert of a step could miss, 30k of them)
            self.n_victims = min(self.cap, MAX_VICTIM_LAYERS * B * self.topk)
            self.victims = (_i64 * (VICTIM_ENTRY * self.n_victims))()
            self.buffers = (_i64 * self.keep)()
            # each load and its eviction, and as many again for reads ahead
            self.log = (_i64 * (LOG_ENTRY * 4 * self.cap))()
            # reads ahead: one layer step's guesses at a time
            self.jobs, self.ahead = (ReadJob * (B * self.topk))(), (_i64 * (3 * B * self.topk))()
            self.guess = (_i64 * (B * self.topk))()
            for t in self.rows.values():
                t.load_state, t.load_buffers = ctypes.addressof(self.state), ctypes.addressof(self.buffers)
                t.load_victims, t.load_log = ctypes.addressof(self.victims), ctypes.addressof(self.log)
            del self._free[self.keep:]
        store, st = self.store, self.state
        hybrid = store.hybrid
        st[LS.KEEP] = int(store.fast.capacity > 0)
        if hybrid is not None and hybrid.on_cpu(B):
            st[LS.FREE] = st[LS.VICTIMS] = st[LS.LOG] = st[LS.READ_NS] = st[LS.READER] = st[LS.AHEAD] = 0
            st[LS.PREDICTED] = st[LS.ACTUAL] = st[LS.CORRECT] = 0
            return
        free, victims = store.offer(self.n_victims) if store.fast.capacity else (0, [])
        cost, layers, get, offered = store.fast.cost, self.layers, store.fast.get, []
        flat: list = []
        for k in victims:  # (a layer's experts all cost the same: its load_cost)
            lay = layers.get(k.layer)
            w = get(k) if self.reuse and lay is not None else None
            buffer = 0
            if w is not None and sys.getrefcount(w) == _SOLE_REFS:
                first, users, address = _buffer_of(w)
                if storage_users(first) == users:  # no one else has a view of its buffer either
                    buffer = address
            offered.append(w if buffer else None)
            flat += (k.layer, k.expert, lay.cost if lay is not None else cost(k), 0, buffer)
        self.victims[:len(flat)] = flat
        self._offered = offered
        take = store.source.buffers.take
        while len(self._free) < self.keep:
            self._free.append(take(self.nbytes))
        self.buffers[:len(self._free)] = [b.data_ptr() for b in self._free]
        st[LS.ROOM], st[LS.FREE], st[LS.VICTIMS], st[LS.NEXT], st[LS.LOG], st[LS.LOG_CAP], st[LS.READ_NS] = (
            free, len(self._free), len(victims), 0, 0, 4 * self.cap, 0)
        reader = store.prefetcher.reads.entry_points() if store.prefetcher is not None and st[LS.KEEP] else None
        st[LS.READER], st[LS.SUBMIT], st[LS.WAIT] = reader or (0, 0, 0)
        st[LS.JOBS], st[LS.NJOBS] = ctypes.addressof(self.jobs), len(self.jobs)
        st[LS.AHEAD_IDS], st[LS.GUESS] = ctypes.addressof(self.ahead), ctypes.addressof(self.guess)
        st[LS.AHEAD] = st[LS.N_GUESS] = st[LS.PREDICTED] = st[LS.ACTUAL] = st[LS.CORRECT] = 0

    def books(self, stopped: int) -> dict[int, dict]:
        """After a call: its loads by layer {layer: {expert: (victims evicted for it, its weights, its table row,
        whether it was read ahead)}} (weights None: read for that step only), for the books of the layer steps it
        ran (`ExpertStore.table_step`); the loads and evictions of the layer it stopped at (a read that failed
        after others), and the victims of reads ahead that failed, are stored now."""
        st, log, store = self.state, self.log, self.store
        by_layer: dict[int, dict] = {}
        victims: list[Key] = []
        failed: list[Key] = []
        for j in range(st[LS.LOG]):
            layer, e, b, kind = log[LOG_ENTRY * j: LOG_ENTRY * j + LOG_ENTRY]
            if b == -2:  # read for this step only (a store that keeps nothing)
                by_layer.setdefault(layer, {})[e] = ([], None, None, False)
                continue
            if b == -1:
                victims.append(Key(layer, e))
                continue
            if kind == KIND.AHEAD_BAD:  # the layer's own load reads it again (and names a problem)
                failed += victims
                victims = []
                continue
            lay = self.layers[layer]
            if b >= 0:  # into a free buffer: its views made here
                buf = self._free[b]
                w, base = store.source.views(buf, lay.span), buf.data_ptr()
            else:  # into an evicted victim's buffer: its weights object (views of that buffer) serves this one
                w = self._offered[-3 - b]
                base = self.victims[VICTIM_ENTRY * (-3 - b) + VICTIM.BUFFER]
            row = tuple(base + o if o >= 0 else 0 for o in lay.row)  # what the call wrote
            by_layer.setdefault(layer, {})[e] = (victims, w, row, kind == KIND.AHEAD)
            victims = []
        del self._free[st[LS.FREE]:]  # the buffers the loads kept (taken from the end)
        self._offered = []  # (an evicted victim's weights must not outlive the store's books here)
        store.in_call_counts(st[LS.READ_NS] / 1e9, st[LS.PREDICTED], st[LS.ACTUAL], st[LS.CORRECT])
        failed += victims
        if failed or stopped in by_layer:
            store.table_step(stopped, None, by_layer.pop(stopped, {}), failed)
        return by_layer
