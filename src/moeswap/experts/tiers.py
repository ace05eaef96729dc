"""Tiers: places an expert can be. `get(key)` -> weights or None, `put(key, weights)`, a byte capacity.

MemoryTier is accelerator memory (CUDA) or host memory (pinned when an accelerator is present); it keeps
experts in its own form: the stored MXFP4 bytes (default) or decoded copies. CheckpointTier is the disk:
the checkpoint itself, read per expert by byte range (pread), never a whole file; `start(key, reads)`
begins such a read on the background reader threads, `start_many(keys, reads)` a layer step's reads in
one submission, and the reader threads check the bytes the format names (MXFP4's scale bytes). Tiers do
no eviction: ExpertStore decides what goes where, under its lock.
"""

from __future__ import annotations

import errno
import math
import os
import threading
import warnings
from functools import partial
from typing import Callable, NamedTuple

import torch

from moeswap.experts.buffers import BufferPool
from moeswap.experts.keys import Key
from moeswap.experts.read_modes import EXPERT_READS
from moeswap.experts.reads import DIRECT_SLACK, Checks, Direct, Pending, Reads, direct_layout, read_now
from moeswap.experts.source import ExpertIndex, check_expert, load_expert
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.ops.expert import ExpertWeights, MXFP4ExpertWeights, tensors
from moeswap.weights.registry import format_of

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

    def start_many(self, keys, reads: Reads, urgent: bool = False) -> list[Pending | BaseException]:
        """`start` for each key, in order; a key that cannot start gets its error in its place."""
        out: list[Pending | BaseException] = []
        for key in keys:
            try:
                out.append(self.start(key, reads, urgent))
            except BaseException as err:  # the demand for it will say so
                out.append(err)
        return out

    def evicted(self, w: Weights) -> None:
        """A cache tier above dropped `w` (what this tier gave it, perhaps): nothing to do here by default."""


def tensors_of(w: Weights) -> list[torch.Tensor]:
    return list(tensors(w).values())


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _byte_shape(shape, dtype: torch.dtype) -> tuple[int, ...]:
    """The uint8 shape of a tensor's bytes: its shape, the last dim times its item size."""
    if dtype.itemsize == 1 or not shape:
        return tuple(shape) if shape else (dtype.itemsize,)
    return (*shape[:-1], shape[-1] * dtype.itemsize)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a read buffer as `dtype` (one-byte dtypes stay uint8: the format reinterprets them): a view
    where the offset allows one (safetensors does not align tensors), else a copy."""
    if dtype.itemsize == 1:
        return raw
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


class _Span(NamedTuple):
    """An expert whose tensors sit together in one file: one read of [start, end) into one buffer."""

    file: object
    start: int
    end: int
    parts: tuple  # (field name, offset in the buffer, bytes, shape) per tensor
    layout: tuple  # (field name, offset, shape) per tensor: experts laid out alike are checked once
    checks: Checks | None  # what the reader checks of the bytes (the format's byte_limit)
    strided: tuple  # (field name, offset, byte shape, contiguous strides, dtype) per tensor: its view of the buffer
    nbytes: int  # the tensors' bytes (the span less any padding)


def convert(w: Weights, decoded: bool, dtype: torch.dtype, device: torch.device, pin: bool = False) -> Weights:
    """`w` in a tier's form: its stored MXFP4 bytes or decoded `dtype` weights, on `device` (pinned if asked);
    the format of its form does it (weights.registry.format_of)."""
    return format_of(w).convert(w, decoded, dtype, device, pin)


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
    (benchmarks use it; clean pages only, so run it on a checkpoint that has been written back).

    reads (EXPERT_READS): direct reads an expert's span by O_DIRECT (bypassing the page cache) into a buffer laid
    out so its bytes land where they are used (reads.direct_layout); buffered reads through the page cache (which
    keeps what fits: a checkpoint smaller than RAM); auto is direct where the file system allows O_DIRECT, and
    once it is refused (on open; a read refused falls back inside the reader) reads buffered and drops what it
    read (POSIX_FADV_DONTNEED), as O_DIRECT would have left the page cache, with a one-time note; `mode` says
    which ran. Experts that are not one span, and the native decode step's in-call loads (whose
    buffers have one layout for every expert), read buffered."""

    name = "disk"
    capacity = math.inf

    def __init__(self, ckpt: Checkpoint, index: ExpertIndex, dtype: torch.dtype, drop_page_cache: bool = False,
                 spare_buffer_bytes: int = 0, pin_background: bool = False, reads: str = "buffered"):
        if reads not in EXPERT_READS:
            raise ValueError(f"expert reads {reads!r}: expected one of {', '.join(EXPERT_READS)}")
        self.ckpt, self.index, self.dtype, self.reads = ckpt, index, dtype, reads
        self.drop_page_cache = drop_page_cache
        self.mode = "direct" if reads in ("direct", "auto") else "buffered"  # what `reads` came to
        self.log = None  # a ReadLog (the store's ReadStats) told of each read of a span
        # background reads for an accelerator go to pinned memory, so their copy up is asynchronous; the
        # pinned allocator, not our pool, knows when that copy is done with the buffer
        self.pin_background = pin_background
        self.buffers = BufferPool(spare_buffer_bytes)  # read buffers, reused once their expert is gone
        self._fds: dict = {}  # our own descriptors, opened on first read of each file
        self._dfds: dict = {}  # ... and their O_DIRECT twins (None: refused for that file)
        self._fd_lock = threading.Lock()
        self._checked_layouts: set = set()
        self._spans: dict = {}
        self._stored: dict = {}  # key -> stored bytes (the disk counter's, asked on every read)

    def get(self, key: Key) -> Weights:
        span = self.span(key)
        if span is None:
            w, bad = load_expert(self.ckpt, self.index, key.layer, key.expert, self.dtype, decode=False), None
        else:
            w, bad = self._read_span(key, span)
        if bad is not False:  # not checked by the reader, or it found a bad byte: say which tensor
            self._check(key, w)
        if self.drop_page_cache:
            self._drop_pages(key)
        return w

    def start(self, key: Key, reads: Reads, urgent: bool = False) -> Pending:
        """An expert kept as its bytes (MXFP4) in one span is read by the reader threads straight into a pooled
        buffer, and its scale bytes checked there; its views are made by whoever takes the result. Anything
        else loads whole on a thread."""
        span = self.span(key)
        if span is None:
            return super().start(key, reads, urgent)
        segments, finish, checks, direct = self._read_job(key, span)
        return reads.read(segments, finish, drop=self.drop_page_cache, urgent=urgent, checks=checks, direct=direct,
                          log=self.log)

    def start_many(self, keys, reads: Reads, urgent: bool = False) -> list[Pending | BaseException]:
        """A layer step's reads: those of spans submitted to the reader threads in one call, in file-offset order
        (the drive reads ahead along the file; several threads keep several reads in flight)."""
        jobs, where, out = [], [], []
        for key in sorted(keys, key=self._place):
            span = self.span(key)
            try:
                if span is None:
                    out.append(super().start(key, reads, urgent))
                    continue
                jobs.append(self._read_job(key, span))
                where.append(len(out))
                out.append(None)
            except BaseException as err:  # the demand for it will say so
                out.append(err)
        for i, pending in zip(where, reads.read_many(jobs, drop=self.drop_page_cache, urgent=urgent, log=self.log)):
            out[i] = pending
        order = sorted(range(len(keys)), key=lambda i: self._place(keys[i]))
        inorder: list = [None] * len(keys)
        for got, i in zip(out, order):
            inorder[i] = got
        return inorder

    def _place(self, key: Key) -> tuple[str, int]:
        """Where the expert's bytes start: (file, offset); an expert that is not one span sorts first."""
        span = self.span(key)
        return ("", 0) if span is None else (span.file, span.start)

    def _read_job(self, key: Key, span: _Span):
        """(segments, finish, checks, direct) of one span's background read."""
        try:
            fd = self.fd(span.file)
        except OSError as err:
            raise CheckpointError(f"{key}: cannot open {span.file}: {err}") from err
        buf, direct = self._buffer(span, pinned=self.pin_background)

        def finish(error: OSError | None, bad: bool | None) -> Weights:
            if error is not None:
                raise CheckpointError(f"{key}: cannot read its tensors from {span.file}: {error}") from error
            w = self.views(buf, span)
            if bad is not False:  # not checked by the reader, or a bad byte: name the tensor
                self._check(key, w)
            return w

        return [(fd, span.start, buf)], finish, span.checks, direct

    def _buffer(self, span: _Span, pinned: bool = False) -> tuple[torch.Tensor, Direct | None]:
        """A buffer for the span's bytes, and how to read it by O_DIRECT (None: buffered)."""
        n = span.end - span.start
        dfd = self.direct_fd(span.file)
        if dfd is None:
            return (torch.empty(n, dtype=torch.uint8, pin_memory=True) if pinned else self.buffers.take(n)), None
        raw = torch.empty(n + DIRECT_SLACK, dtype=torch.uint8, pin_memory=True) if pinned else \
            self.buffers.take(n + DIRECT_SLACK)
        buf, head, tail = direct_layout(raw, span.start, n)
        return buf, Direct(dfd, head, tail)

    def direct_fd(self, file) -> int | None:
        """The file opened with O_DIRECT, or None: buffered reads asked for, or O_DIRECT refused for it (auto
        notes it once and the tier reads buffered from then on; direct refuses to go on, at every read)."""
        if self.mode != "direct":
            return None
        file = file if type(file) is str else str(file)
        if file in self._dfds:
            dfd = self._dfds[file]
            if dfd is None:  # refused before: --expert-reads direct says so again (auto reads buffered by now)
                self.refused(file)
            return dfd
        with self._fd_lock:
            if file not in self._dfds:
                try:
                    self._dfds[file] = os.open(file, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) \
                        if hasattr(os, "O_DIRECT") else None
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self._dfds[file] = None
                if self._dfds[file] is None:
                    self.refused(file)
            return self._dfds[file]

    def refused(self, file: str) -> None:
        """O_DIRECT is refused for `file` (on open, or by a read): buffered from now on (auto), or an error."""
        if self.reads == "direct":
            raise CheckpointError(f"--expert-reads direct: the file system of {file} refuses O_DIRECT; use "
                                  f"--expert-reads auto or buffered")
        if self.mode == "direct":
            warnings.warn(f"moeswap: O_DIRECT refused for {file}: reading experts buffered (through the page "
                          f"cache, dropping what was read)", RuntimeWarning, stacklevel=2)
        self.mode, self.drop_page_cache = "buffered", True
        if self.log is not None:
            self.log.mode = self.mode

    def put(self, key: Key, weights: Weights) -> Weights:
        raise TypeError("the checkpoint tier is read-only")

    def evicted(self, w: Weights) -> None:
        """A cache tier dropped w: if it lives in one of our read buffers, the next read may reuse it."""
        first = next(iter(tensors(w).values()))
        if first.is_cpu:  # (not .device.type: it makes a device object per call, on every eviction)
            self.buffers.released(first)  # (nothing, for tensors that are not views of a read buffer)

    def stored_bytes(self, key: Key) -> int:
        n = self._stored.get(key)
        if n is None:
            n = self._stored[key] = self.index.stored_bytes(self.ckpt, key.layer, key.expert)
        return n

    def _check(self, key: Key, w: Weights) -> None:
        check_expert(self.ckpt, self.index, key.layer, key.expert, w)

    def span(self, key: Key) -> _Span | None:
        """Where the expert is kept as its stored bytes (MXFP4, block FP8, INT4) and its tensors sit together in
        one file (as published checkpoints store them): one pread into one buffer, which eviction returns whole."""
        if key in self._spans:
            return self._spans[key]
        infos = {(proj, kind): self.ckpt.info(name) for proj, kinds in self.index.names(*key).items()
                 for kind, name in kinds.items()}
        span = None
        fmt = self.index.format
        if fmt.keeps_bytes and len({i.file for i in infos.values()}) == 1:
            start = min(i.offset for i in infos.values())
            end = max(i.offset + i.nbytes for i in infos.values())
            if end - start <= sum(i.nbytes for i in infos.values()) + (64 << 10):  # at most a little padding read
                parts = tuple((f"{proj}_{kind.removeprefix('weight_')}", i.offset - start, i.nbytes, tuple(i.shape))
                              for (proj, kind), i in infos.items())
                dtypes = {f"{proj}_{kind.removeprefix('weight_')}": i.dtype for (proj, kind), i in infos.items()}
                checks = None
                if fmt.byte_limit is not None:
                    suffix, limit = fmt.byte_limit
                    checks = Checks(tuple((o, n) for name, o, n, _ in parts if name.endswith(suffix)), limit)
                # the file as a str: it keys the descriptors, looked up on every read (a Path hashes in Python)
                span = _Span(str(next(iter(infos.values())).file), start, end, parts,
                             tuple((name, o, shape) for name, o, _, shape in parts), checks,
                             tuple((name, o, _byte_shape(shape, dtypes[name]),
                                    _contiguous_strides(_byte_shape(shape, dtypes[name])), dtypes[name])
                                   for name, o, _, shape in parts),
                             sum(n for _, _, n, _ in parts))
        self._spans[key] = span
        return span

    def _read_span(self, key: Key, span: _Span) -> tuple[Weights, bool | None]:
        """The expert read on this thread, and whether a checked byte is bad (None: not checked)."""
        try:
            buf, direct = self._buffer(span)
            refused = self.log.refused if self.log is not None else 0
            bad = read_now(self.fd(span.file), span.start, buf, span.checks, direct, self.log)
            if direct is not None and self.log is not None and self.log.refused > refused:
                self.refused(span.file)
        except OSError as err:
            raise CheckpointError(f"{key}: cannot read its tensors from {span.file}: {err}") from err
        return self.views(buf, span), bad

    def views(self, buf: torch.Tensor, span: _Span) -> Weights:
        """The expert `span` describes, as views of the read buffer `buf` that holds its bytes."""
        # one as_strided per tensor: a slice and a view cost twice as much, and this runs for every load
        base = buf.storage_offset()
        views = {name: _typed(buf.as_strided(shape, stride, base + o), dtype)
                 for name, o, shape, stride, dtype in span.strided}
        # every expert has the same layout: check the first one fully
        checked = span.layout in self._checked_layouts
        w = self.index.format.from_bytes(views, checked=checked, nbytes=span.nbytes)
        if not checked:
            self._checked_layouts.add(span.layout)
        return w

    def fd(self, file) -> int:
        file = file if type(file) is str else str(file)  # one key per file, however it is named
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
                os.posix_fadvise(self.fd(span.file), span.start, span.end - span.start, os.POSIX_FADV_DONTNEED)
            except (AttributeError, OSError):
                pass
            return
        for kinds in self.index.names(key.layer, key.expert).values():
            for name in kinds.values():
                info = self.ckpt.info(name)
                try:
                    os.posix_fadvise(self.fd(info.file), info.offset, info.nbytes, os.POSIX_FADV_DONTNEED)
                except (AttributeError, OSError):
                    return  # not available here: reads stay cached, which only makes the disk look faster

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._dfds.values()]:
            if fd is not None:
                os.close(fd)
        self._fds.clear()
        self._dfds.clear()
        self.buffers.clear()
