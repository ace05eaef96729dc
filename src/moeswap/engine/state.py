"""Per-sequence state of a batch (KDA recurrent + conv state, MLA latent cache).

`SlotStates` preallocates the state of up to `slots` sequences of up to `max_len` tokens once; live
sequences occupy slots 0..n-1, so a step runs on views of the first n rows and nothing is copied or
allocated per step (the layers update state in place). A sequence that leaves is replaced by the last
one (a row copy per layer).
The AttnRes bank is per token (it mixes depth, not time), so nothing of it carries between steps.
State larger than the device's memory is refused before it is allocated.
"""

from __future__ import annotations

import os

import torch

from moeswap.models.kimi_k3 import ModelState
from moeswap.models.layers.kda import KDAState
from moeswap.models.layers.mla import MLACache
from moeswap.units import human_bytes


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


class SlotStates:
    """State buffers for `slots` sequences of at most `max_len` tokens each (prompt + generated)."""

    def __init__(self, model, slots: int, max_len: int, dtype: torch.dtype | None = None, device=None):
        self.slots, self.max_len, self.dtype = slots, max_len, dtype
        one = model.make_state(1, dtype, device)
        need = slots * sum(st.recurrent_BHKK.nbytes + st.conv_BWC.nbytes if isinstance(st, KDAState)
                           else max_len * st.latent_BSX.shape[-1] * st.latent_BSX.element_size()
                           for st in one.layers)
        first = one.layers[0]
        have = device_memory((first.recurrent_BHKK if isinstance(first, KDAState) else first.latent_BSX).device)
        # torch.zeros touches every page: past the machine's memory the OOM killer ends the process, no error
        if have is not None and need > have:
            raise ValueError(f"the state of {slots} sequence(s) of {max_len} tokens needs {human_bytes(need)}, "
                             f"more than this device's {human_bytes(have)}: ask for fewer tokens (max_tokens) "
                             f"or sequences")
        try:
            self.full = model.make_state(slots, dtype, device)
            for st in self.full.layers:
                if isinstance(st, MLACache):  # sized once: appends never reallocate, so views stay valid
                    st.latent_BSX = torch.zeros(slots, max_len, st.latent_BSX.shape[-1],
                                                dtype=st.latent_BSX.dtype, device=st.latent_BSX.device)
        except torch.OutOfMemoryError:
            raise ValueError(f"out of memory for the state of {slots} sequence(s) of {max_len} tokens "
                             f"({human_bytes(need)}): ask for fewer tokens (max_tokens) or sequences") from None
        self.lengths = [0] * slots  # host copy of every slot's cached tokens
        self._views: dict[tuple[int, int], ModelState] = {}

    def view(self, start: int, stop: int) -> ModelState:
        """The state of slots start..stop-1 as views; the model's in-place updates land in the buffers.
        Kept per range (a decode step asks for the same one every step); only the host lengths change."""
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
