"""The expert store's cache: `fetch(layer, ids)` -> experts ready for compute, from the fastest tier holding them
(fast tier, optional host tier, checkpoint); a miss is promoted into every cache tier above, each evicting by
its CachePolicy within its budget; the step's experts and the next layer's hinted ones are pinned (a prefetch
never evicts them; a demand may, so nothing waits forever). Mixins add the rest: loads.py (background loads),
native_protocol.py (a caller that loads by itself), holds.py (autograd holds). Knows nothing of models; entry
point: `experts.build.build_store`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

import torch

from moeswap.experts.holds import GraphHolds
from moeswap.experts.keys import Key
from moeswap.experts.loads import BackgroundLoads, Load
from moeswap.experts.native_protocol import InCallLoads
from moeswap.experts.policy import CachePolicy
from moeswap.experts.source import ExpertIndex
from moeswap.experts.stats import StoreStats, TierStats
from moeswap.experts.tiers import Tier, Weights, tensors_of
from moeswap.formats.checkpoint import Checkpoint


class _Pinned:
    """Membership test over the store's pins, without building a set per eviction."""

    def __init__(self, store: ExpertStore):
        self._s = store

    def __contains__(self, key) -> bool:
        s = self._s
        if key in s._active:
            return True
        hint = s._hints.get(key[0])
        return hint is not None and key in hint[2]


class Fetched(Sequence):
    """The experts of one fetch. Each is looked up (and loaded if needed) when indexed and not kept here,
    so a prefill that touches every expert of a layer never holds more than the store's budget."""

    __slots__ = ("_store", "_keys")

    def __init__(self, store: ExpertStore, keys: list[Key]):
        self._store, self._keys = store, keys

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._store._get(k) for k in self._keys[i]]
        return self._store._get(self._keys[i])

    def ready(self, i: int) -> bool:
        """Whether indexing expert i now would not wait for a read (a caller computes what it has meanwhile)."""
        return self._store._ready_now(self._keys[i])


class ExpertStore(BackgroundLoads, InCallLoads, GraphHolds):
    """The store. Its state and the cache are here; BackgroundLoads, InCallLoads and GraphHolds add the methods
    of the prefetcher, of a caller that loads by itself, and of autograd graphs, on the same state."""

    def __init__(self, tiers: Sequence[Tier], policies: Sequence[CachePolicy], max_hint: int | None = None):
        """tiers: MemoryTiers fastest first, then the source of truth (the checkpoint); one policy per
        MemoryTier. A fast tier of capacity 0 keeps nothing: every fetch reads the source."""
        if len(policies) != len(tiers) - 1:
            raise ValueError(f"one policy per cache tier: {len(tiers) - 1} tiers, {len(policies)} policies")
        self.tiers, self.policies = list(tiers), list(policies)
        self.fast, self.source = self.tiers[0], self.tiers[-1]
        self.stats = StoreStats({t.name: TierStats() for t in self.tiers[:-1]})
        self.trace = None  # a TraceRecorder, when recording
        self.prefetcher = None  # a Prefetcher, when prefetching
        self.hybrid = None  # experts/hybrid.py HybridExperts: computes experts the fast tier lacks on the CPU
        self.max_hint = max_hint  # most experts one hint may load (None: no limit)
        # False when the fast tier can hold every expert (build_store knows): then no eviction ever
        # asks the policy, and hits skip its books (docs/benchmarks.md)
        self.can_evict = True
        # True: a layer step's (or a hint's) background loads are begun under one lock and submitted to the
        # readers in one call; False: one call each (the same decisions, kept as the oracle of tests/benches)
        self.batch_loads = True
        self._lock = threading.RLock()
        self._loaded = threading.Condition(self._lock)  # a load is done (for a demand on another thread)
        self._waiting = 0  # demands waiting on _loaded
        # a policy with CachePolicy's own victim() can take a run of evictions with the same pins at once
        self._batch_victims = type(self.policies[0]).victim is CachePolicy.victim
        self._aside: list | None = None  # pinned residents passed over in such a run
        self._reserved = [0] * (len(self.tiers) - 1)  # bytes promised to loads in flight, per cache tier
        self._inflight: dict[Key, Load] = {}
        self._active: set[Key] = set()  # the layer step being computed
        self._pending: set[Key] = set()  # ... and not yet asked for (what read-ahead may still load)
        self._hints: dict[int, tuple[int, frozenset[int], set[Key]]] = {}  # layer -> (fetch no., predicted, to load)
        self._fetches = 0
        self._unused: set[Key] = set()  # loaded by prefetch, not yet used
        self._events: dict[Key, object] = {}  # CUDA: copy-done events of prefetched experts
        self._pins = _Pinned(self)
        self._holds: dict[Key, weakref.WeakSet] = {}  # experts that live graphs keep, and their holds
        self._mirrors: dict[int, list] = {}  # layer -> what mirrors its fast-tier experts (`mirror`)
        # a fast tier that keeps nothing (streaming, --expert-policy none): the experts its background loads read
        # for a layer step not yet begun (the next layer's guess), kept until that step takes them or ends
        self._staged: dict[Key, Weights] = {}
        self._log_reads()

    def _log_reads(self) -> None:
        """The checkpoint tells this store's books of each read it makes (stats.disk_io)."""
        if hasattr(self.source, "log"):
            self.source.log = self.stats.disk_io
            self.stats.disk_io.mode = self.source.mode

    # -- the API --------------------------------------------------------------------------------------

    @property
    def ckpt(self) -> Checkpoint:
        return self.source.ckpt

    @property
    def index(self) -> ExpertIndex:
        return self.source.index

    def fetch(self, layer: int, expert_ids: Sequence[int], takes_all: bool = False) -> Sequence[Weights]:
        """The experts `expert_ids` of `layer` (one layer step), ready for compute when indexed: a list
        when all are in the fast tier, else a `Fetched` that loads each when asked for it. With a prefetcher,
        the misses are read ahead on the reader threads while the first experts compute; `takes_all`: the
        caller takes every expert before it computes any (the native decode step), so its first miss is read
        on its own thread meanwhile, not handed to a reader and waited for."""
        ids = [int(e) for e in expert_ids]
        keys = [Key(layer, e) for e in ids]
        with self._lock:
            if self.trace is not None:
                self.trace.record(layer, ids)
            self._begin_step(layer, ids, keys)
            if not self._events:  # (CUDA: a prefetched expert's copy must be waited for when indexed)
                resident = [self.fast.get(k) for k in keys]
                if None not in resident:  # all hits: hand them over now; pinned (_active) for the step
                    self._pending = set()
                    for key in keys:
                        self._hit(key)
                    return resident
            self._pending = set(keys)
            missing = [k for k in keys if k not in self.fast and k not in self._inflight and k not in self._staged]
        if takes_all:
            missing = missing[1:]
        if self.prefetcher is not None and missing:
            self.prefetcher.readahead(missing)  # load later experts of this step while earlier ones compute
        return Fetched(self, keys)

    def mirror(self, layer: int, table) -> None:
        """Keep `table` (one of any number per layer) told of `layer`'s experts in the fast tier:
        `table.added(expert, w)` for each one now and each one stored later, `table.removed(expert)` before one
        is evicted (under the store's lock, on the thread that made the store call). A decode step then reads
        the table for the experts it can compute without a fetch (models/layers/moe.py; on CUDA,
        engine/cuda_graph.py) and books those hits with `table_hits`."""
        with self._lock:
            self._mirrors.setdefault(layer, []).append(table)
            for key in self.fast.keys():
                if key.layer == layer:
                    table.added(key.expert, self.fast.get(key))

    def count_routing(self, pairs: int, distinct: int) -> None:
        """A layer step that fetched `distinct` experts for `pairs` (token, expert) pairs: what dedup reports."""
        with self._lock:
            self.stats.routed_pairs += pairs
            self.stats.fetched += distinct

    def table_hits(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A layer step served from `layer`'s mirror table without a fetch: the books a fetch of these
        (all resident) experts keeps: hits, the policy's recency, prefetch use, the layer's hint scored."""
        ids = [int(e) for e in expert_ids]
        keys = [Key(layer, e) for e in ids]
        with self._lock:
            self._begin_step(layer, ids, keys)
            self._pending = set()
            for key in keys:
                self._hit(key)

    def count_resident_hits(self, n: int) -> None:
        """n fast-tier hits served without a fetch by a store that never evicts (can_evict False: no policy
        to tell); an evicting store's table hits go through `table_hits`."""
        with self._lock:
            self.stats.fast.hits += n

    def resident(self, layer: int, expert_ids: Sequence[int], fill: bool = False) -> list[bool]:
        """Which of `expert_ids` the fast tier holds now (books nothing). fill: also those it lacks that fit,
        in order, in its free bytes (what no load has promised), so that fetching them evicts nothing."""
        with self._lock:
            fast = self.fast
            free = fast.capacity - fast.used - self._reserved[0] if fill else 0
            out = []
            for e in expert_ids:
                key = Key(layer, int(e))
                if key in fast:
                    out.append(True)
                elif key not in self._inflight and 0 < fast.cost(key) <= free:
                    free -= fast.cost(key)
                    out.append(True)
                else:
                    out.append(False)
            return out

    def read_host(self, layer: int, expert: int) -> Weights:
        """Expert `expert` of `layer` in host memory, from a host tier or read from the checkpoint (and put
        into the host tiers), without storing it in the fast tier: for computing it on the CPU where it is
        (experts/hybrid.py). Books host-tier hits and misses and disk reads, no fast-tier miss."""
        key = Key(layer, int(expert))
        with self._lock:
            w = self._from_host(key) if len(self.tiers) > 2 else None
        if w is None:
            w = self._promote(key, self.source.get(key))
        return w

    def preload(self, keys, reset_stats: bool = True) -> None:
        """Load `keys` into the fast tier (e.g. every expert, for an all-resident run); stats are reset unless
        told not to (the loads are then counted as misses)."""
        for key in keys:
            self._get(Key(*key))
        if reset_stats:
            self.reset_stats()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = StoreStats({t.name: TierStats() for t in self.tiers[:-1]})
            self._unused.clear()
            self._log_reads()

    def close(self) -> None:
        if self.prefetcher is not None:
            with self._lock:  # no read may outlive the reader: drop the queued ones, take the rest
                for load in [l for l in self._inflight.values() if l.pending is not None]:
                    if load.pending.cancel():
                        self._complete(load, None, stored=False)
                    else:
                        load.pending.wait()
                        self._finish(load)
            self.prefetcher.close()
        if hasattr(self.source, "close"):
            self.source.close()

    def _ready_now(self, key: Key) -> bool:
        """Whether `key` is at hand without a read to wait for (no lock: a stale answer only moves a flush)."""
        if key in self.fast or key in self._staged:
            return True
        load = self._inflight.get(key)
        return load is not None and (load.done or (load.pending is not None and load.pending.ready()))

    # -- demand path ----------------------------------------------------------------------------------

    def _get(self, key: Key) -> Weights:
        with self._lock:
            self._pending.discard(key)
            w = self.fast.get(key)
            if w is not None:
                self._hit(key)
                return self._ready(key, w)
            self.stats.fast.misses += 1
            staged = self._staged.pop(key, None) if self._staged else None
            if staged is not None:  # read ahead for this step (keeps nothing: not stored)
                self.stats.prefetch.used += 1
                return staged
            load = self._inflight.get(key)
            mine = load is None
            if mine:
                load = self._begin(key, strict=True)
            else:
                self.stats.prefetch.late += 1
            pending = load.pending
        t0 = time.perf_counter()
        if mine:
            self._load_now(load)
        elif pending is not None:
            pending.wait()  # outside the lock: the read runs on a reader thread
        else:
            with self._lock:  # another thread's demand for the same expert
                self._waiting += 1
                self._loaded.wait_for(lambda: load.done)
                self._waiting -= 1
        with self._lock:
            if not load.done:
                self._finish(load)
            self._staged.pop(key, None)  # (taken here: not kept for later)
            self.stats.stall_s += time.perf_counter() - t0
            if load.error is None:
                self.policies[0].record(key)
                self._unused.discard(key)
        if load.error is not None:
            raise load.error
        return self._ready(key, load.value)

    def _begin_step(self, layer: int, ids: list[int], keys: list[Key]) -> None:
        """Under the lock: a layer step begins: its hint scored, older hints dropped, its experts pinned,
        finished background loads taken in."""
        hint = self._hints.pop(layer, None)
        if hint is not None:  # score the lookahead's guess for this layer step
            p = self.stats.prefetch
            p.predicted += len(hint[1])
            p.actual += len(set(ids))
            p.correct += len(hint[1].intersection(ids))
        # hints older than the previous fetch are for layer steps that are gone
        self._hints = {l: h for l, h in self._hints.items() if h[0] >= self._fetches}
        self._fetches += 1
        self._active = set(keys)
        if self._staged:  # read ahead for a step that is gone
            stale = [k for k in self._staged if k.layer != layer]
            for k in stale:
                del self._staged[k]
            self.stats.prefetch.wasted += len(stale)
        self._harvest()

    def _hit(self, key: Key) -> None:
        """Under the lock: the books of a fast-tier hit."""
        self.stats.fast.hits += 1
        if self.can_evict:
            self.policies[0].record(key)
        if key in self._unused:
            self._unused.discard(key)
            self.stats.prefetch.used += 1

    # -- loading ----------------------------------------------------------------------------------------

    def _begin(self, key: Key, strict: bool) -> Load | None:
        """Under the lock: make room in the fast tier and register the load; None if a non-strict
        (prefetch) load would have to evict a pinned expert."""
        need = self.fast.cost(key) if self.fast.capacity else 0
        if need and not self._make_room(0, need, strict):
            return None
        load = Load(key, need)
        self._inflight[key] = load
        self._reserved[0] += need
        return load

    def _load_now(self, load: Load) -> None:
        """A demand miss: read on this thread, outside the lock."""
        t0 = time.perf_counter()
        try:
            w = None
            if len(self.tiers) > 2:
                with self._lock:
                    w = self._from_host(load.key)
            if w is None:
                w = self._promote(load.key, self.source.get(load.key))
            load.value = self.fast.form(w)
        except BaseException as err:  # re-raised to the caller by _get
            load.error = err
        with self._lock:
            self.stats.load_s += time.perf_counter() - t0
            self._complete(load, load.value)

    def _complete(self, load: Load, value, stored: bool = True) -> None:
        """Under the lock: the load is over; a good one goes into the fast tier."""
        key = load.key
        load.pending = None
        self._reserved[0] -= load.need
        del self._inflight[key]
        if stored and load.error is None and self.fast.capacity:
            self.fast.put(key, value)
            self.policies[0].insert(key)
            for mirror in self._mirrors.get(key.layer, ()):
                mirror.added(key.expert, value)
            self.stats.fast.bytes_in += load.need
            if load.event is not None:
                self._events[key] = load.event
            if load.background:
                self._unused.add(key)
                self.stats.prefetch.loaded += 1
        elif stored and load.error is None and load.background and value is not None:
            self._staged[key] = value  # (a demand taking it now drops it again)
            self.stats.prefetch.loaded += 1
        load.value = value
        load.done = True
        if self._waiting:
            self._loaded.notify_all()

    def _from_host(self, key: Key) -> Weights | None:
        """Under the lock: the expert from a host tier between the fast tier and the checkpoint."""
        for i in range(1, len(self.tiers) - 1):
            w = self.tiers[i].get(key)
            self.policies[i].record(key)
            st = self.stats.tiers[self.tiers[i].name]
            if w is not None:
                st.hits += 1
                return w
            st.misses += 1
        return None

    def _promote(self, key: Key, w: Weights) -> Weights:
        """An expert just read from the checkpoint, put into every host tier on the way up."""
        nbytes = self.source.stored_bytes(key) if hasattr(self.source, "stored_bytes") else 0
        for i in range(1, len(self.tiers) - 1):
            tier = self.tiers[i]
            formed = tier.form(w)
            with self._lock:
                if key not in tier and self._make_room(i, tier.cost(key), strict=True):
                    tier.put(key, formed)
                    self.policies[i].insert(key)
                    self.stats.tiers[tier.name].bytes_in += tier.cost(key)
            w = formed
        with self._lock:
            self.stats.disk_reads += 1
            self.stats.disk_bytes += nbytes
        return w

    def _make_room(self, i: int, need: int, strict: bool) -> bool:
        """Under the lock: evict from cache tier i until `need` more bytes fit. Pinned experts go only
        for a strict (demand) load; if nothing at all is left to evict (everything is in flight), a
        demand goes over budget by that one load rather than wait."""
        tier, policy = self.tiers[i], self.policies[i]
        while tier.used + self._reserved[i] + need > tier.capacity:
            if i == 0 and self._aside is not None:
                victim = policy.victim(self._pins, self._aside)
            else:
                victim = policy.victim(self._pins if i == 0 else ())
            if victim is None and strict and i == 0:
                victim = policy.victim(())
            if victim is None:
                return strict
            self._evict(i, victim)
        return True

    def _evict(self, i: int, victim: Key, taken_over=None) -> None:
        """Under the lock: the books of evicting `victim` from cache tier i (its policy has let it go);
        `taken_over`: the weights a caller's load kept, with their buffer, for another expert."""
        tier = self.tiers[i]
        if i == 0:  # before its bytes can go
            for mirror in self._mirrors.get(victim.layer, ()):
                mirror.removed(victim.expert)
        dropped = tier.drop(victim)
        if i == 0:
            self._release_holds(victim)  # graphs let go of it too: its bytes leave the budget
        if dropped is not None and dropped is not taken_over:
            self.source.evicted(dropped)  # its read buffer is likely free for the next read
        self.stats.tiers[tier.name].evictions += 1
        if i == 0 and victim in self._unused:
            self._unused.discard(victim)
            self.stats.prefetch.wasted += 1

    def _ready(self, key: Key, w: Weights) -> Weights:
        """CUDA: the first use of a prefetched expert waits for its side-stream copy, and tells the
        allocator the main stream uses that memory (so freeing it on eviction waits for this work)."""
        if self._events:
            with self._lock:
                event = self._events.pop(key, None)
            if event is not None:
                stream = torch.cuda.current_stream()
                stream.wait_event(event)
                for t in tensors_of(w):
                    t.record_stream(stream)
        return w
