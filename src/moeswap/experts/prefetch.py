"""Prefetch: load experts before the model asks for them.

`Prefetcher.hint(layer, ids)` queues a guess for a coming layer step; `readahead(keys)` queues the rest
of the step being computed. One background thread loads them into the store's fast tier (on CPU it
overlaps reads and decodes with compute; on CUDA it copies on a side stream). Hints never block the
model and never evict pinned experts. `NextLayerLookahead` is the model hook that makes the guesses:
layer l+1's router applied to layer l's hidden state. It gets the routers as callables from the loader,
so this module knows nothing of models.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from moeswap.experts.keys import Key


class Prefetcher:
    def __init__(self, store):
        self._store = store
        self._urgent: deque[Key] = deque()  # the current layer step: needed soonest
        self._hinted: deque[Key] = deque()
        self._wake = threading.Condition()
        self._closed = False
        cuda = store.fast.device.type == "cuda"
        self._stream = torch.cuda.Stream(store.fast.device) if cuda else None
        self._thread = threading.Thread(target=self._work, name="moeswap-prefetch", daemon=True)
        self._thread.start()

    def hint(self, layer: int, expert_ids: Sequence[int]) -> None:
        """A guess of the experts `layer` will use in this step, best first."""
        keys = self._store.note_hint(layer, expert_ids)
        with self._wake:
            self._hinted.clear()  # older guesses are for layers already computed
            self._hinted.extend(keys)
            self._wake.notify()

    def readahead(self, keys: Sequence[Key]) -> None:
        with self._wake:
            self._urgent.clear()
            self._urgent.extend(keys)
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _work(self) -> None:
        if self._stream is not None:
            torch.cuda.set_stream(self._stream)  # this thread's copies run beside the model's stream
        while True:
            with self._wake:
                while not (self._closed or self._urgent or self._hinted):
                    self._wake.wait()
                if self._closed:
                    return
                key = (self._urgent or self._hinted).popleft()
            try:
                self._store._prefetch(key)
            except Exception:  # a failed load is re-raised to the demand that waits for it
                pass


class NextLayerLookahead:
    """Model hook `(layer, hidden)`: called before layer `layer` computes its MLP, it predicts the experts
    of the next MoE layer from this hidden state and hints them, most-chosen first.

    routes: layer -> (next MoE layer, router(hidden [T, D]) -> expert ids [T, K])."""

    def __init__(self, routes: dict[int, tuple[int, Callable[[torch.Tensor], torch.Tensor]]], prefetcher: Prefetcher):
        self.routes, self.prefetcher = routes, prefetcher

    @torch.no_grad()
    def __call__(self, layer: int, hidden: torch.Tensor) -> None:
        route = self.routes.get(layer)
        if route is None:
            return
        target, route_fn = route
        ids_TK = route_fn(hidden.reshape(-1, hidden.shape[-1]))
        ids, counts = ids_TK.flatten().unique(return_counts=True)
        order = counts.argsort(descending=True, stable=True)
        self.prefetcher.hint(target, ids[order].tolist())
