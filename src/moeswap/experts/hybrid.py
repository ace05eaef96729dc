"""Hybrid experts (`--expert-compute gpu|cpu|auto`): where a routed expert the fast tier lacks is computed:
copied up and computed there (gpu: the store without this); read into host memory and computed by the CPU's
kernels, never copied up (cpu: the fast tier fills its free room first, then keeps what it holds); cpu below
`min_tokens` tokens a step, gpu from there (auto, EXPERT_GPU_MIN_TOKENS). Owns the per-step choice and
the mixed fetch (the store's `stats.hybrid`); the executors compute what it hands them. Knows no model. Entry
points: `HybridExperts.fetch` (the store's `hybrid`, experts/build.py), `fetch_step` (for a layer step).
"""

from __future__ import annotations

from collections.abc import Sequence

# --expert-compute: where a routed expert the fast tier lacks is computed. The planner's
# `plan --offload-compute` models the same choice under its own names: gpu = swap, cpu = host, auto = auto.
EXPERT_COMPUTE = ("gpu", "cpu", "auto")
# auto: a layer step of at least this many tokens copies its missing experts up and computes there; fewer
# compute them on the CPU. A missed expert costs one copy of its bytes up whatever the tokens, while its CPU
# time grows with its rows: decode (a few tokens, most experts touched by one) is far cheaper on the CPU,
# a long prefill (many rows per expert) on the accelerator. 32 is llama.cpp's switch for the same choice
# (ggml's op offload of host-weight ops to the GPU from a batch of 32) and the planner's `auto` uses it too.
EXPERT_GPU_MIN_TOKENS = 32


def fetch_step(store, layer: int, expert_ids: Sequence[int], tokens: int, **kw) -> Sequence:
    """A layer step's experts (of `tokens` tokens): `store.fetch`, or with hybrid experts (the store's `hybrid`)
    its fetch, where those the fast tier lacks may come from host memory. `kw`: the store fetch's keywords."""
    hybrid = getattr(store, "hybrid", None)
    return store.fetch(layer, expert_ids, **kw) if hybrid is None else hybrid.fetch(layer, expert_ids, tokens, **kw)


class HybridFetched(Sequence):
    """One layer step's experts, in the order asked: those of the fast tier (a store fetch) and those read
    into host memory (`host[i]` True: computed on the CPU). Each is looked up when indexed, as a fetch's."""

    __slots__ = ("_fast", "_where", "_read", "host")

    def __init__(self, fast: Sequence, where: list[int | None], read, host: list[bool]):
        self._fast, self._where, self._read, self.host = fast, where, read, host

    def __len__(self) -> int:
        return len(self.host)

    def __getitem__(self, i: int):
        j = self._where[i]
        return self._read(i) if j is None else self._fast[j]


class HybridExperts:
    """The store's `hybrid`: `fetch(layer, ids, tokens)` in place of `store.fetch(layer, ids)`."""

    def __init__(self, store, mode: str = "cpu", min_tokens: int = EXPERT_GPU_MIN_TOKENS):
        if mode not in EXPERT_COMPUTE or mode == "gpu":
            raise ValueError(f"hybrid experts for --expert-compute {mode!r}: expected cpu or auto")
        self.store, self.mode, self.min_tokens = store, mode, min_tokens

    def on_cpu(self, tokens: int) -> bool:
        """Whether a layer step of `tokens` tokens computes the experts the fast tier lacks on the CPU."""
        return self.mode == "cpu" or tokens < self.min_tokens

    def fetch(self, layer: int, expert_ids: Sequence[int], tokens: int, takes_all: bool = False) -> Sequence:
        """The step's experts: a plain store fetch where every one is resident or the step goes to the
        accelerator, else a HybridFetched whose missing experts come from host memory. `takes_all` as the
        store's fetch."""
        ids = [int(e) for e in expert_ids]
        store = self.store
        if store.trace is not None:  # a routing trace wants every step's whole set in one fetch
            return store.fetch(layer, ids, takes_all)
        if not self.on_cpu(tokens):
            if not all(store.resident(layer, ids)):
                store.stats.hybrid.fetch_steps += 1
            return store.fetch(layer, ids, takes_all)
        held = store.resident(layer, ids)
        if all(held):
            return store.fetch(layer, ids, takes_all)
        fits = store.resident(layer, ids, fill=True)
        stats = store.stats.hybrid  # (the store's: reset with its other counters)
        stats.filled += sum(f and not h for f, h in zip(fits, held, strict=True))
        if all(fits):
            return store.fetch(layer, ids, takes_all)
        stats.cpu_steps += 1
        stats.cpu_experts += fits.count(False)
        fast_ids = [e for e, f in zip(ids, fits, strict=True) if f]
        where, n = [], 0
        for f in fits:
            where.append(n if f else None)
            n += f
        # one fetch of the fast tier's part, so the store sees the step (pins, policy books, hint scoring)
        fast = store.fetch(layer, fast_ids, takes_all)
        return HybridFetched(fast, where, lambda i: store.read_host(layer, ids[i]), [not f for f in fits])
