"""Per-sequence state of a batch (KDA recurrent + conv state, MLA latent cache), sized to what is in use.

`SlotStates` holds the state of the live sequences in rows 0..n-1 of one buffer per layer, so a step runs
on views of the first n rows and the layers update state in place. The buffers grow as sequences join
(rows) and as the longest one grows (MLA capacity, about doubling) and shrink once a quarter is in use;
`reserve` grows them before a step. A reallocation bumps `generation` (views taken before are stale).
The AttnRes bank is per token (it mixes depth, not time), so nothing of it carries between steps.
"""

from __future__ import annotations

import os

import torch

from moeswap.models.decoder import ModelState
from moeswap.models.layers.kda import KDAState
from moeswap.models.layers.mla import MLACache
from moeswap.units import human_bytes

MIN_CAPACITY = 64  # MLA tokens per row at the least, and the unit capacity is rounded up to


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on `device` (the machine's RAM for the CPU), or None where it cannot be told."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
    except (ValueError, OSError, RuntimeError, AssertionError):
        pass
    return None


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class SlotStates:
    """State buffers for up to `slots` sequences of at most `max_len` tokens each (prompt + generated)."""

    def __init__(self, model, slots: int, max_len: int, dtype: torch.dtype | None = None, device=None):
        self.slots, self.max_len, self.dtype = slots, max_len, dtype
        self._model, self._device = model, device
        one = model.make_state(1, dtype, device)  # the layout: one sequence, an empty MLA cache
        self.fixed_bytes = sum(st.recurrent_BHKK.nbytes + st.conv_BWC.nbytes for st in one.layers
                               if isinstance(st, KDAState))  # a sequence's state whatever its length
        self.token_bytes = sum(st.latent_BSX.shape[-1] * st.latent_BSX.element_size() for st in one.layers
                               if isinstance(st, MLACache))  # and per token it holds
        need = slots * (self.fixed_bytes + max_len * self.token_bytes)
        first = one.layers[0]
        have = device_memory((first.recurrent_BHKK if isinstance(first, KDAState) else first.latent_BSX).device)
        # the buffers grow up to `need`, and torch.zeros touches every page: past the machine's memory the
        # OOM killer ends the process, with no error; so the most they can grow to must fit
        if have is not None and need > have:
            raise ValueError(f"the state of {slots} sequence(s) of {max_len} tokens needs {human_bytes(need)}, "
                             f"more than this device's {human_bytes(have)}: ask for fewer tokens (max_tokens) "
                             f"or sequences")
        self.rows, self.capacity = 0, 0
        self.full = self._allocate(0, 0)
        self.lengths = [0] * slots  # host copy of every slot's cached tokens
        self.generation = 0  # bumped by each reallocation
        self._views: dict[tuple[int, int], ModelState] = {}

    # -- sizes --------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes the buffers hold now (every row, the MLA caches at their capacity)."""
        return self.rows * (self.fixed_bytes + self.capacity * self.token_bytes)

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes the state of one sequence of `tokens` tokens takes, without rounding."""
        return self.fixed_bytes + tokens * self.token_bytes

    def reserve(self, start: int, stop: int, tokens: int) -> None:
        """Make rows start..stop-1 exist and room for `tokens` more tokens in each (the MLA capacity grows to
        at least twice what it was, in MIN_CAPACITY units, so that growing costs O(1) copies per token)."""
        rows, cap = self.rows, self.capacity
        if stop > rows:
            rows = min(self.slots, max(stop, 2 * rows))
        need = max(self.lengths[start:stop], default=0) + tokens
        if need > self.max_len:
            raise ValueError(f"a slot would hold {need} tokens, more than max_len {self.max_len}")
        if need > cap and self.token_bytes:
            cap = min(_round_up(self.max_len, MIN_CAPACITY), _round_up(max(need, 2 * cap), MIN_CAPACITY))
        if (rows, cap) != (self.rows, self.capacity):
            self._resize(rows, cap)

    def fit(self, live: int) -> None:
        """Shrink to the `live` sequences in rows 0..live-1 once a quarter of the rows or of the MLA
        capacity is in use (to half of it: the next growth then copies nothing soon)."""
        rows, cap = self.rows, self.capacity
        if rows > 1 and max(live, 1) * 4 <= rows:
            rows = max(live, 1) * 2
        longest = max(self.lengths[:live], default=0) + 1  # the next decode step's token
        if cap > MIN_CAPACITY and longest * 4 <= cap:
            cap = max(MIN_CAPACITY, _round_up(2 * longest, MIN_CAPACITY))
        if (rows, cap) != (self.rows, self.capacity):
            self._resize(rows, cap)

    def _allocate(self, rows: int, cap: int) -> ModelState:
        state = self._model.make_state(rows, self.dtype, self._device)
        for st in state.layers:
            if isinstance(st, MLACache):  # one capacity for every row: a batch is one [rows, capacity, X] buffer
                st.latent_BSX = torch.zeros(rows, cap, st.latent_BSX.shape[-1],
                                            dtype=st.latent_BSX.dtype, device=st.latent_BSX.device)
        return state

    def _resize(self, rows: int, cap: int) -> None:
        try:
            grown = self._allocate(rows, cap)
        except torch.OutOfMemoryError:
            raise ValueError(f"out of memory for the state of {rows} sequence(s) of {cap} tokens "
                             f"({human_bytes(rows * self.sequence_bytes(cap))}): ask for fewer tokens "
                             f"(max_tokens) or sequences") from None
        keep, held = min(rows, self.rows), min(cap, self.capacity)
        for new, old in zip(grown.layers, self.full.layers):
            if isinstance(new, KDAState):
                new.recurrent_BHKK[:keep].copy_(old.recurrent_BHKK[:keep])
                new.conv_BWC[:keep].copy_(old.conv_BWC[:keep])
            else:
                new.latent_BSX[:keep, :held].copy_(old.latent_BSX[:keep, :held])
                new.lengths_B[:keep].copy_(old.lengths_B[:keep])
        self.full, self.rows, self.capacity = grown, rows, cap
        self.generation += 1
        self._views.clear()

    # -- views and rows -----------------------------------------------------------------------------
    def view(self, start: int, stop: int) -> ModelState:
        """The state of slots start..stop-1 as views; the model's in-place updates land in the buffers.
        Kept per range (a decode step asks for the same one every step) until a reallocation; only the
        host lengths change. `reserve` the step's tokens first: a cache that grew by itself would leave."""
        longest = max(self.lengths[start:stop])
        kept = self._views.get((start, stop))
        if kept is not None:
            for st in kept.layers:
                if isinstance(st, MLACache):
                    st.max_length = longest
            return kept
        layers = []
        for st in self.full.layers:
            if isinstance(st, KDAState):
                layers.append(KDAState(st.recurrent_BHKK[start:stop], st.conv_BWC[start:stop]))
            else:
                layers.append(MLACache(st.latent_BSX[start:stop], st.lengths_B[start:stop], longest))
        self._views[(start, stop)] = ModelState(layers)
        return self._views[(start, stop)]

    def advance(self, start: int, stop: int, tokens: int) -> None:
        """Record on the host that slots start..stop-1 each took `tokens` more tokens."""
        for i in range(start, stop):
            self.lengths[i] += tokens
            if self.lengths[i] > self.max_len:
                raise ValueError(f"slot {i} holds {self.lengths[i]} tokens, more than max_len {self.max_len}")

    def clear(self, slot: int) -> None:
        """An empty slot for a new sequence (its row made to exist)."""
        self.lengths[slot] = 0
        self.reserve(slot, slot + 1, 0)
        for st in self.full.layers:
            if isinstance(st, KDAState):
                st.recurrent_BHKK[slot].zero_()
                st.conv_BWC[slot].zero_()
            else:
                st.lengths_B[slot] = 0  # stale latent rows are masked by the length
        self.lengths[slot] = 0

    def wipe(self, slot: int) -> None:
        """Zero every row of the slot. Masked attention multiplies stale cache rows by probability 0, which
        keeps NaN or Inf: a failed sequence's rows must not stay behind for the slot's next occupants."""
        for st in self.full.layers:
            if isinstance(st, KDAState):
                st.recurrent_BHKK[slot].zero_()
                st.conv_BWC[slot].zero_()
            else:
                st.latent_BSX[slot].zero_()
                st.lengths_B[slot] = 0
        self.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Copy slot src into slot dst (the rows of every layer, the MLA cache up to its length)."""
        n = self.lengths[src]
        for st in self.full.layers:
            if isinstance(st, KDAState):
                st.recurrent_BHKK[dst].copy_(st.recurrent_BHKK[src])
                st.conv_BWC[dst].copy_(st.conv_BWC[src])
            else:
                st.latent_BSX[dst, :n].copy_(st.latent_BSX[src, :n])
                st.lengths_B[dst] = st.lengths_B[src]
        self.lengths[dst] = n

    def swap(self, a: int, b: int) -> None:
        """Exchange slots a and b (every layer's rows; the MLA caches up to the longer of the two)."""
        if a == b:
            return
        n = max(self.lengths[a], self.lengths[b])
        pair, back = [a, b], [b, a]
        for st in self.full.layers:
            if isinstance(st, KDAState):
                st.recurrent_BHKK[pair] = st.recurrent_BHKK[back]
                st.conv_BWC[pair] = st.conv_BWC[back]
            else:
                st.latent_BSX[pair, :n] = st.latent_BSX[back, :n]
                st.lengths_B[pair] = st.lengths_B[back]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]
