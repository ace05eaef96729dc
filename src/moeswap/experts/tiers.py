"""Tiers: places an expert can be. `get(key)` -> weights or None, `put(key, weights)`, a byte capacity.

MemoryTier is accelerator memory (CUDA) or host memory (pinned when an accelerator is present); it keeps
experts in its own form: the stored MXFP4 bytes (default) or decoded copies. CheckpointTier is the disk:
the checkpoint itself, read per expert by byte range (pread), never a whole file; `start(key, reads)`
begins such a read on the background reader threads. Tiers do no eviction: ExpertStore decides what
goes where, under its lock.
"""

from __future__ import annotations

import math
import os
import threading
from functools import partial
from typing import Callable

import torch

from moeswap.experts.buffers import BufferPool
from moeswap.experts.keys import Key
from moeswap.experts.reads import Pending, Reads, pread_exactly
from moeswap.experts.source import ExpertIndex, check_expert, load_expert
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights, tensors

Weights = ExpertWeights | MXFP4ExpertWeights


class Tier:
    name: str
    capacity: float  # bytes; math.inf for the checkpoint

    def get(self, key: Key) -> Weights | None:
        raise NotImplementedError

    def put(self, key: Key, weights: Weights) -> Weights:
        raise NotImplementedError

    def start(self, key: Key, reads: Reads, urgent: bool = False) -> Pending:
        """Begin loading `key` off the caller's thread; `result()` gives what get() would have."""
        return reads.call(partial(self.get, key), urgent)

    def evicted(self, w: Weights) -> None:
        """A cache tier above dropped `w` (what this tier gave it, perhaps): nothing to do here by default."""


def tensors_of(w: Weights) -> list[torch.Tensor]:
    return list(tensors(w).values())


def convert(w: Weights, decoded: bool, dtype: torch.dtype, device: torch.device, pin: bool = False) -> Weights:
    """`w` in a tier's form: its stored MXFP4 bytes or decoded `dtype` weights, on `device` (pinned if asked);
    the format of its form does it (ops.expert_format)."""
    return w.fmt.convert(w, decoded, dtype, device, pin)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a read buffer as `dtype` (one-byte dtypes stay uint8: the format reinterprets them): a view
    where the offset allows one (safetensors does not align tensors), else a copy."""
    if dtype.itemsize == 1:
        return raw
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


class MemoryTier(Tier):
    """A dict of experts in one form on one device. `form(w)` converts to that form (the slow part: a
    decode or a device copy, done before taking the store's lock); `put` stores an already-formed expert.
    `cost(key)` is the bytes a key takes here, known before reading it, so the store can make room first."""

    def __init__(self, name: str, capacity: int, cost: Callable[[Key], int],
                 form: Callable[[Weights], Weights] = lambda w: w, device: str | torch.device = "cpu"):
        self.name, self.capacity, self.cost, self.form = name, capacity, cost, form
        self.device = torch.device(device)
        self.used = 0
        self._items: dict[Key, Weights] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[Key]:
        return list(self._items)

    def get(self, key: Key) -> Weights | None:
        return self._items.get(key)

    def put(self, key: Key, weights: Weights) -> Weights:
        if key not in self._items:
            self.used += self.cost(key)
        self._items[key] = weights
        return weights

    def drop(self, key: Key) -> Weights | None:
        """Forgets the key; returns what it held (None if nothing)."""
        w = self._items.pop(key, None)
        if w is not None:
            self.used -= self.cost(key)
        return w


class CheckpointTier(Tier):
    """The checkpoint on disk: always has every expert, takes none. Reads only the expert's byte ranges
    (one pread when its tensors are adjacent, else one per tensor) and checks what it read, so a bad
    expert fails here naming layer, expert and file.

    drop_page_cache: after each read, ask the OS to drop those pages (posix_fadvise DONTNEED), so the
    next read of that expert comes from the device again, as it would for a checkpoint larger than RAM
    (benchmarks use it; clean pages only, so run it on a checkpoint that has been written back)."""

    name = "disk"
    capacity = math.inf

    def __init__(self, ckpt: Checkpoint, index: ExpertIndex, dtype: torch.dtype, drop_page_cache: bool = False,
                 spare_buffer_bytes: int = 0, pin_background: bool = False):
        self.ckpt, self.index, self.dtype, self.drop_page_cache = ckpt, index, dtype, drop_page_cache
        # background reads for an accelerator go to pinned memory, so their copy up is asynchronous; the
        # pinned allocator, not our pool, knows when that copy is done with the buffer
        self.pin_background = pin_background
        self.buffers = BufferPool(spare_buffer_bytes)  # read buffers, reused once their expert is gone
        self._fds: dict = {}  # our own descriptors, opened on first read of each file
        self._fd_lock = threading.Lock()
        self._checked_layouts: set = set()
        self._spans: dict = {}

    def get(self, key: Key) -> Weights:
        span = self._span(key)
        w = self._read_span(key, *span) if span else load_expert(self.ckpt, self.index, key.layer, key.expert,
                                                                 self.dtype, decode=False)
        self._check(key, w)
        if self.drop_page_cache:
            self._drop_pages(key)
        return w

    def start(self, key: Key, reads: Reads, urgent: bool = False) -> Pending:
        """An expert kept as its bytes (MXFP4) in one span is read by the reader threads straight into a pooled
        buffer; its views and checks are made by whoever takes the result. Anything else loads whole on a thread."""
        span = self._span(key)
        if span is None:
            return super().start(key, reads, urgent)
        file, start, end, parts = span
        try:
            fd = self._fd(file)
        except OSError as err:
            raise CheckpointError(f"{key}: cannot open {file}: {err}") from err
        n = end - start
        buf = torch.empty(n, dtype=torch.uint8, pin_memory=True) if self.pin_background else self.buffers.take(n)

        def finish(error: OSError | None) -> Weights:
            if error is not None:
                raise CheckpointError(f"{key}: cannot read its tensors from {file}: {error}") from error
            w = self._views(buf, parts)
            self._check(key, w)
            return w

        return reads.read([(fd, start, buf)], finish, drop=self.drop_page_cache, urgent=urgent)

    def put(self, key: Key, weights: Weights) -> Weights:
        raise TypeError("the checkpoint tier is read-only")

    def evicted(self, w: Weights) -> None:
        """A cache tier dropped w: if it lives in one of our read buffers, the next read may reuse it."""
        first = tensors_of(w)[0]
        if first.device.type == "cpu":
            self.buffers.released(first)  # (nothing, for tensors that are not views of a read buffer)

    def stored_bytes(self, key: Key) -> int:
        return self.index.stored_bytes(self.ckpt, key.layer, key.expert)

    def _check(self, key: Key, w: Weights) -> None:
        check_expert(self.ckpt, self.index, key.layer, key.expert, w)

    def _span(self, key: Key):
        """(file, start, end, parts) when the expert is kept as its stored bytes (MXFP4, FP8, INT4) and its tensors sit
        together in one file (as published checkpoints store them): one pread into one buffer, which
        eviction returns whole."""
        if key in self._spans:
            return self._spans[key]
        infos = {(proj, kind): self.ckpt.info(name) for proj, kinds in self.index.names(*key).items()
                 for kind, name in kinds.items()}
        span = None
        if self.index.format.keeps_bytes and len({i.file for i in infos.values()}) == 1:
            start = min(i.offset for i in infos.values())
            end = max(i.offset + i.nbytes for i in infos.values())
            if end - start <= sum(i.nbytes for i in infos.values()) + (64 << 10):  # at most a little padding read
                parts = {f"{proj}_{kind.removeprefix('weight_')}": (i.offset - start, i.nbytes, i.shape, i.dtype)
                         for (proj, kind), i in infos.items()}
                span = (next(iter(infos.values())).file, start, end, parts)
        self._spans[key] = span
        return span

    def _read_span(self, key: Key, file, start: int, end: int, parts) -> Weights:
        buf = self.buffers.take(end - start)
        try:
            pread_exactly(self._fd(file), buf, start)
        except OSError as err:
            raise CheckpointError(f"{key}: cannot read its tensors from {file}: {err}") from err
        return self._views(buf, parts)

    def _views(self, buf: torch.Tensor, parts) -> Weights:
        views = {name: _typed(buf[o : o + n], dtype).view(shape) for name, (o, n, shape, dtype) in parts.items()}
        layout = tuple((name, o, tuple(shape)) for name, (o, _, shape, _) in parts.items())
        # every expert has the same layout: check the first one fully
        w = self.index.format.from_bytes(views, checked=layout in self._checked_layouts)
        self._checked_layouts.add(layout)
        return w

    def _fd(self, file) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._fd_lock:  # reader threads may open files too
                if file not in self._fds:
                    self._fds[file] = os.open(file, os.O_RDONLY)
                fd = self._fds[file]
        return fd

    def _drop_pages(self, key: Key) -> None:
        span = self._spans.get(key)
        if span:
            try:
                os.posix_fadvise(self._fd(span[0]), span[1], span[2] - span[1], os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                pass
            return
        for kinds in self.index.names(key.layer, key.expert).values():
            for name in kinds.values():
                info = self.ckpt.info(name)
                try:
                    os.posix_fadvise(self._fd(info.file), info.offset, info.nbytes, os.POSIX_FADV_DONTNEED)
                except (AttributeError, OSError):
                    return  # not available here: reads stay cached, which only makes the disk look faster

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.buffers.clear()
