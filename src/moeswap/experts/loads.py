"""Background loads, the prefetcher's side of the ExpertStore (a mixin of it, on the store's lock, tiers and
books: experts/store.py). A `Load` is one expert on its way into the fast tier (a demand's or a background
one). Hints (`note_hint`) pin a guess of the next layer's experts; its loads (or a layer step's) are begun
under one lock and submitted to the reader threads in one call (`start_background_many`), which only move
and check bytes; the rest (views, the books, the copy up) happens on the model's thread, at its next fetch
or when it needs that expert (`_harvest`, `_finish`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from moeswap.experts.keys import Key
from moeswap.experts.reads import Done
from moeswap.experts.tiers import Weights


class Load:
    """One expert on its way into the fast tier. A background load has `pending` (its read, running on
    the prefetcher's reader threads); the model's thread finishes it when it is needed or ready. `done`
    once it is over (another thread's demand waits for that on the store's `_loaded` condition)."""

    __slots__ = ("key", "need", "pending", "from_source", "background", "done", "value", "error", "event")

    def __init__(self, key: Key, need: int):
        self.key, self.need = key, need
        self.pending = None
        self.from_source = self.background = self.done = False
        self.value = self.error = self.event = None


class BackgroundLoads:
    """ExpertStore's methods for the prefetcher (experts/prefetch.py) and the native step's `settle`."""

    def note_hint(self, layer: int, expert_ids: Sequence[int]) -> list[Key]:
        """Records a lookahead guess for `layer` (best first) and pins it; returns the keys worth loading."""
        ids = [int(e) for e in expert_ids]
        with self._lock:
            load = [Key(layer, e) for e in ids if Key(layer, e) not in self.fast][: self.max_hint]
            self._hints[layer] = (self._fetches, frozenset(ids), set(load))
        return load

    def start_background(self, key: Key, urgent: bool) -> bool:
        """Start reading `key` on the reader threads if it is still wanted and fits without evicting a
        pinned expert; False if not started (dropped). The model's thread finishes it later (_harvest)."""
        with self._lock:
            if key in self.fast or key in self._inflight:
                return False
            hint = self._hints.get(key.layer)
            wanted = key in self._pending or (hint is not None and key in hint[2])
            load = self._begin(key, strict=False) if wanted else None
            if load is None:
                self.stats.prefetch.dropped += 1
                return False
            load.background = True
            try:
                load.pending = self._start_read(load, urgent)
            except BaseException as err:  # e.g. the file is gone: the demand for it will say so
                load.error = err
                self._complete(load, None)
            return True

    def start_background_many(self, keys, urgent: bool) -> list[Key]:
        """start_background for each key in order, under one lock, with the reads of those the checkpoint
        serves submitted to the readers in one call; returns the keys started."""
        started, reads = [], []
        with self._lock:
            # the pins do not change in this loop: the fast tier's policy passes over each pinned resident
            # once for all the evictions it makes room with (same victims as one at a time)
            self._aside = [] if self._batch_victims else None
            try:
                self._begin_many(keys, started, reads)
            finally:
                if self._aside is not None:
                    self.policies[0].put_back(self._aside)
                    self._aside = None
            if reads:
                try:
                    pendings = self.source.start_many([l.key for l in reads], self.prefetcher.reads, urgent)
                except BaseException as err:  # e.g. the reader is closed: the demands will say so
                    pendings = [err] * len(reads)
                for load, pending in zip(reads, pendings):
                    if isinstance(pending, BaseException):
                        load.error = pending
                        self._complete(load, None)
                    else:
                        load.pending = pending
        return started

    def _begin_many(self, keys, started: list[Key], reads: list[Load]) -> None:
        """Under the lock: start_background's checks and books for each key in order; the loads the
        checkpoint must serve go to `reads`."""
        for key in keys:
            if key in self.fast or key in self._inflight:
                continue
            hint = self._hints.get(key.layer)
            wanted = key in self._pending or (hint is not None and key in hint[2])
            load = self._begin(key, strict=False) if wanted else None
            if load is None:
                self.stats.prefetch.dropped += 1
                continue
            load.background = True
            started.append(key)
            w = self._from_host(key)
            if w is not None:
                load.pending = Done(w)
            else:
                load.from_source = True
                reads.append(load)

    def cancel_background(self, keys) -> None:
        """Drop the loads of `keys` that have not started reading (an older hint's)."""
        with self._lock:
            for key in keys:
                load = self._inflight.get(key)
                if load is not None and load.background and load.pending is not None and load.pending.cancel():
                    load.error = RuntimeError(f"{key}: prefetch cancelled")
                    self._complete(load, None, stored=False)
                    self.stats.prefetch.dropped += 1

    def settle(self, layer: int) -> None:
        """Take `layer`'s background loads (a hint's) whose reads are done into the fast tier now, so into its
        mirror table: for a caller about to compute that layer from the table without asking the store first
        (the native decode step resuming its call after a stop), where a load left for the store's next look
        would make it stop there anyway. Reads still in flight are left to overlap its compute (a large
        expert's read takes longer than a layer)."""
        with self._lock:
            self._harvest(layer)

    def _harvest(self, layer: int | None = None) -> None:
        """Under the lock: finish background loads (of `layer`, or all) whose reads are done (store them, free
        their books)."""
        for load in [l for l in self._inflight.values() if l.pending is not None and l.pending.ready()
                     and (layer is None or l.key.layer == layer)]:
            self._finish(load)

    def _start_read(self, load: Load, urgent: bool):
        """Under the lock: a host tier's copy, or a read of the checkpoint started on the reader threads."""
        w = self._from_host(load.key)
        if w is not None:
            return Done(w)
        load.from_source = True
        return self.source.start(load.key, self.prefetcher.reads, urgent)

    def _finish(self, load: Load) -> None:
        """Under the lock: take a background load's result (its read is done or waited for) into the tier."""
        t0, value = time.perf_counter(), None
        try:
            w = load.pending.result()
            if load.from_source:
                w = self._promote(load.key, w)
            value = self._form_background(load, w)
        except BaseException as err:
            load.error = err
        self.stats.load_s += time.perf_counter() - t0
        self._complete(load, value)

    def _form_background(self, load: Load, w: Weights) -> Weights:
        """CUDA: the copy of a prefetched expert runs on the prefetcher's side stream, and its first
        use waits for it (_ready)."""
        stream = getattr(self.prefetcher, "stream", None)
        if stream is None:
            return self.fast.form(w)
        with torch.cuda.stream(stream):
            value = self.fast.form(w)
            load.event = torch.cuda.Event()
            load.event.record()
        return value
