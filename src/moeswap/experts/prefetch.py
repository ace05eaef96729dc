"""Prefetch: load experts before the model asks for them.

`Prefetcher.hint(layer, ids)` starts loading a guess for a coming layer step; `readahead(keys)` the rest
of the step being computed, ahead of hints. Reads run on the reader threads (experts/reads.py) while the
model computes; the store finishes them on the model's thread (on CUDA, copying on a side stream).
Hints never block the model and never evict pinned experts. `NextLayerLookahead` is the model hook that
makes the guesses: layer l+1's router applied to layer l's hidden state. It gets the routers as callables
from the loader, so this module knows nothing of models.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from moeswap.experts.keys import Key
from moeswap.experts.read_modes import DEFAULT_THREADS
from moeswap.experts.reads import Reads

# up to this many guessed (token, slot) pairs, counting in Python beats torch's unique and argsort
# (docs/benchmarks.md): a decode step's handful, where the native decode step guesses at every layer that stops
GUESSES_IN_PYTHON = 256


class Prefetcher:
    def __init__(self, store, threads: int = DEFAULT_THREADS, native: bool = True, lookahead: bool = True):
        """lookahead: the model hints the next layer's experts (NextLayerLookahead); else only read-ahead."""
        self._store, self.lookahead = store, lookahead
        self.reads = Reads(threads, native)
        cuda = store.fast.device.type == "cuda"
        self.stream = torch.cuda.Stream(store.fast.device) if cuda else None  # copies beside the model's
        self._hinted: list[Key] = []

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A guess of the experts `layer` will use in this step, best first."""
        store = self._store
        store.cancel_background(self._hinted)  # older guesses are for layers already computed
        load = store.note_hint(layer, expert_ids)
        if store.batch_loads:
            self._hinted = store.start_background_many(load, urgent=False)
        else:
            self._hinted = [k for k in load if store.start_background(k, urgent=False)]

    def readahead(self, keys: Sequence[Key]) -> None:
        """The step being computed needs `keys`: load them before later hints."""
        if self._store.batch_loads:
            self._store.start_background_many(keys, urgent=True)
            return
        for key in keys:
            self._store.start_background(key, urgent=True)

    def close(self) -> None:
        self.reads.close()


class NextLayerLookahead:
    """Model hook `(layer, hidden)`: called before layer `layer` computes its MLP, it predicts the experts
    of the next MoE layer from this hidden state and hints them, most-chosen first (ties: lower id first).

    routes: layer -> (layer + 1, an MoE layer; its norm and router(hidden [T, D]) -> expert ids [T, K])."""

    def __init__(self, routes: dict[int, tuple[int, Callable[[torch.Tensor], torch.Tensor]]], prefetcher: Prefetcher):
        self.routes, self.prefetcher = routes, prefetcher

    @torch.no_grad()
    def __call__(self, layer: int, hidden: torch.Tensor) -> None:
        route = self.routes.get(layer)
        if route is None:
            return
        self.guessed(layer, route[1](hidden.reshape(-1, hidden.shape[-1])))

    def guessed(self, layer: int, ids_TK: torch.Tensor) -> None:
        """Hint the next MoE layer's experts from its router's ids on layer `layer`'s hidden state, computed by
        the caller (the native decode step's call routes it at a stop): the hook without its own routing."""
        route = self.routes.get(layer)
        if route is None:
            return
        target = route[0]
        if ids_TK.numel() <= GUESSES_IN_PYTHON:
            counts = Counter(ids_TK.flatten().tolist())
            self.prefetcher.hint(target, sorted(counts, key=lambda e: (-counts[e], e)))
            return
        ids, counts = ids_TK.flatten().unique(return_counts=True)
        order = counts.argsort(descending=True, stable=True)
        self.prefetcher.hint(target, ids[order].tolist())
