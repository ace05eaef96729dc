"""A bounded store of decoded experts over a checkpoint: fetch(layer, ids) -> ExpertWeights.

Experts are decoded from the checkpoint on first use and kept in a least-recently-used cache whose
size is a byte budget; peak memory is the dense weights plus that budget plus one step's experts.
This is the single-tier base of the swap core (tiers, policies and prefetch build on it).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, asdict
from typing import Sequence

import torch

from moeswap.experts.source import ExpertIndex, load_expert
from moeswap.formats.checkpoint import Checkpoint
from moeswap.ops.expert import ExpertWeights


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0  # stored (packed) bytes read from the checkpoint
    load_seconds: float = 0.0
    evictions: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hits / max(1, self.hits + self.misses)
        return d


def return_large_frees_to_os(threshold: int = 1 << 20) -> None:
    """Serve allocations >= threshold with mmap so freeing them returns memory to the OS.

    Decoded experts come and go in MB-sized blocks; glibc's default (a threshold that grows up to
    32 MiB) keeps them in the heap, which measured ~500 MB above budget on a 1.2 GB-expert model.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            pass  # not glibc: nothing to tune


class CheckpointExpertStore:
    def __init__(self, ckpt: Checkpoint, index: ExpertIndex, dtype: torch.dtype, device="cpu",
                 capacity_bytes: int = 1 << 30):
        return_large_frees_to_os()
        self.ckpt, self.index, self.dtype, self.device = ckpt, index, dtype, device
        self.capacity_bytes = capacity_bytes
        self.cache: OrderedDict[tuple[int, int], ExpertWeights] = OrderedDict()
        self.cached_bytes = 0
        self.stats = StoreStats()

    def fetch(self, layer: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        out = [self._get(layer, e) for e in expert_ids]
        self._evict(keep=len(expert_ids))
        return out

    def _get(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        if key in self.cache:
            self.stats.hits += 1
            self.cache.move_to_end(key)
            return self.cache[key]
        self.stats.misses += 1
        t0 = time.perf_counter()
        weights = load_expert(self.ckpt, self.index, layer, expert, self.dtype, self.device)
        self.stats.load_seconds += time.perf_counter() - t0
        self.stats.bytes_read += self.index.stored_bytes(self.ckpt, layer, expert)
        self.cache[key] = weights
        self.cached_bytes += weights.nbytes
        return weights

    def _evict(self, keep: int) -> None:
        """Drop least recently used experts over budget, never the `keep` just fetched for this step."""
        while self.cached_bytes > self.capacity_bytes and len(self.cache) > keep:
            _, w = self.cache.popitem(last=False)
            self.cached_bytes -= w.nbytes
            self.stats.evictions += 1
