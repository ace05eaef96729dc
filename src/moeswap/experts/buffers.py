"""Reusable host buffers for expert reads from disk: a fresh mmap-served buffer page-faults on first touch.
Hands out buffers nothing references any more and keeps at most `spare_bytes` of unreferenced ones; the
store names each expert it evicts (`released`) and `take` tries those buffers first. Knows nothing of tiers.
Entry points: `BufferPool(spare_bytes).take(nbytes)`, `.released(tensor)`.
"""

from __future__ import annotations

import collections
import threading

import torch


def storage_users(t: torch.Tensor) -> int:
    """References to t's storage: 2 when only t holds it (t, and the temporary this call makes)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class BufferPool:
    def __init__(self, spare_bytes: int):
        self.spare_bytes = spare_bytes
        self._lock = threading.Lock()
        self._buffers: dict[int, torch.Tensor] = {}  # every buffer handed out and not yet released, by pointer
        self._evicted: collections.deque[torch.Tensor] = collections.deque()  # likely free: try these first
        self.enabled = hasattr(torch._C, "_storage_Use_Count")  # private API: without it, no reuse
        self.reused = self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of nbytes, with arbitrary contents, that nobody else references."""
        if not self.enabled:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            mine = None
            while self._evicted and mine is None:
                b = self._evicted.popleft()
                if b.numel() == nbytes and storage_users(b) == 2 and self._buffers.get(b.data_ptr()) is b:
                    mine = b
            if mine is None:
                mine = next((b for b in self._buffers.values() if b.numel() == nbytes and storage_users(b) == 2),
                            None)
            if mine is not None:
                self.reused += 1
                return mine.view(-1)  # a new tensor on the storage: holding it counts as a use
            # about to grow: first release spare buffers beyond the allowance, oldest first
            free = [b for b in self._buffers.values() if storage_users(b) == 2]
            spare = sum(b.numel() for b in free)
            for b in free:
                if spare <= self.spare_bytes:
                    break
                del self._buffers[b.data_ptr()]
                spare -= b.numel()
            mine = torch.empty(nbytes, dtype=torch.uint8)
            self._buffers[mine.data_ptr()] = mine
            self.allocated += 1
            return mine.view(-1)

    def released(self, t: torch.Tensor) -> None:
        """t (a view into one of our buffers, or anything else) belonged to an expert just evicted: its
        buffer is likely free by the next `take`."""
        with self._lock:
            b = self._buffers.get(t.untyped_storage().data_ptr())
            if b is not None:
                self._evicted.append(b)

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
            self._evicted.clear()
