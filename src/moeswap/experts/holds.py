"""Autograd holds, a mixin of ExpertStore (on the store's lock and fast tier: experts/store.py): what a graph
keeps of an expert for its backward (`hold` -> Held) is the expert itself only while the fast tier holds it;
evicting it lets the hold go (`_release_holds`) and the backward fetches it again, so graphs never keep
bytes outside the budget.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from moeswap.experts.keys import Key
from moeswap.experts.tiers import Weights

if TYPE_CHECKING:
    from moeswap.experts.store import ExpertStore


class Held:
    """An expert kept by an autograd graph for its backward (what weights.autograd.Held is for a store):
    `w` while the fast tier holds the same expert, None once the store has evicted it; `get()` fetches it
    again then."""

    __slots__ = ("_store", "key", "w", "__weakref__")

    def __init__(self, store: ExpertStore, key: Key):
        self._store, self.key, self.w = store, key, None

    def get(self) -> Weights:
        w = self.w
        return w if w is not None else self._store._refetch(self)


class GraphHolds:
    """ExpertStore's methods for autograd graphs (models/layers/moe.py's training forward)."""

    def hold(self, layer: int, expert: int, w: Weights) -> Held:
        """What an autograd graph keeps of expert `w` (just fetched) for its backward: `w` itself while the
        fast tier holds it (its bytes are counted there), nothing once evicted (the backward fetches it
        again). Outside the fast tier (capacity 0) it keeps nothing from the start."""
        held = Held(self, Key(layer, expert))
        with self._lock:
            self._attach(held, w)
        return held

    def graph_bytes(self) -> int:
        """Bytes of the experts live graphs keep (all of them in the fast tier, counted in its `used`)."""
        with self._lock:
            return sum(self.fast.cost(k) for k, holds in self._holds.items() if len(holds))

    def _attach(self, held: Held, w: Weights) -> None:
        """Under the lock: let `held` keep `w` if the fast tier holds this very expert."""
        if self.fast.get(held.key) is w:
            held.w = w
            self._holds.setdefault(held.key, weakref.WeakSet()).add(held)
            self.stats.graph.held += 1

    def _refetch(self, held: Held) -> Weights:
        """A backward pass needs an expert its graph let go: fetch it as a demand (pinned while it loads)."""
        with self._lock:
            self._active = {held.key}  # the forward's layer step is over
            self.stats.graph.refetched += 1
        w = self._get(held.key)
        with self._lock:
            self._attach(held, w)
        return w

    def _release_holds(self, key: Key) -> None:
        """Under the lock: the fast tier evicted `key`: the graphs that keep it let it go."""
        for held in self._holds.pop(key, ()):
            held.w = None
            self.stats.graph.released += 1
