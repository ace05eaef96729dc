"""Background loads for the expert store: work that runs off the model's thread, and what is left of it.

`Reads.read(segments, ...)` reads byte ranges of files into buffers on native threads (native_reads.c,
compiled on first use) that never take the GIL, and checks the bytes it is told to (`Checks`: MXFP4's
scale bytes); `read_many` submits a layer step's reads in one call. `Reads.call(fn)` runs any loader on a
Python thread (the fallback when the C reader cannot be built, and for tiers that are not plain byte
ranges). Both return a `Pending`: `ready()` never blocks, `result()` waits and then runs the caller's
`finish` on the calling thread, so what touches Python objects (views, the store's books) happens on
the model's thread, and the reader threads only move and check bytes. `read_now` does one read and its
checks in C on the calling thread (a demand miss).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from moeswap.experts.read_modes import DEFAULT_THREADS
from moeswap.formats.checkpoint import pread_into
from moeswap.ops.kernel_abi import JOB_HEADER, job_abi, list_problem, struct_problem

SOURCE = Path(__file__).with_name("native_reads.c")
HEADER = JOB_HEADER  # msw_job, the read and its check
# O_DIRECT reads: offsets, lengths and buffer addresses aligned to this (the largest logical block size of common
# drives; a buffer laid out for a read has DIRECT_SLACK bytes beyond the expert's for it: `direct_layout`)
DIRECT_ALIGN = 4096
DIRECT_SLACK = 3 * DIRECT_ALIGN


class ReadJob(ctypes.Structure):
    """ops/csrc/expert_read.h `msw_job`: its fields as MSW_JOB_FIELDS lists them, compared with the reader
    library's own layout, field by field, before the library is used."""

    _fields_ = job_abi().fields


_DONE, _CANCELLED = job_abi().states["DONE"], job_abi().states["CANCELLED"]  # msw_job.state (MSW_JOB_STATES)
_CHECKS = ReadJob.check_off.size // ctypes.sizeof(ctypes.c_int64)  # MSW_CHECKS


class Checks(NamedTuple):
    """Byte ranges (offset, length) of a read's buffer whose bytes must all be <= `max_byte`; the reader
    checks them after the read (MXFP4's scale bytes: ExpertFormat.byte_checks)."""

    ranges: tuple[tuple[int, int], ...]
    max_byte: int


class ReadLog(Protocol):
    """What is told of each read done: when it ran (CLOCK_MONOTONIC ns, as time.monotonic_ns), its bytes, and
    how (1 O_DIRECT, 0 buffered, -1 O_DIRECT refused so buffered): experts/stats.py ReadStats."""

    def read(self, t0_ns: int, t1_ns: int, nbytes: int, direct: int) -> None: ...


_lib_lock = threading.Lock()
_lib: list = []  # [the loaded library or None], once tried


class _Native:
    """The compiled reader's functions. Those that can block (wait, free, a read on this thread) drop the
    GIL (CDLL); the quick ones (submit, cancel, done: a mutex held only for queue operations) keep it
    (PyDLL), since dropping and retaking it per call cost more than the call on a busy 2-core machine."""

    def __init__(self, path: str):
        blocking, quick = ctypes.CDLL(path), ctypes.PyDLL(path)
        problem = layout_problem(quick)
        if problem is not None:
            raise RuntimeError(f"the reader library does not match {HEADER.name}: {problem}")
        job_p = ctypes.POINTER(ReadJob)
        self.new = blocking.msw_reads_new
        self.new.restype, self.new.argtypes = ctypes.c_void_p, [ctypes.c_int]
        self.wait = blocking.msw_reads_wait
        self.wait.restype, self.wait.argtypes = None, [ctypes.c_void_p, job_p]
        self.free = blocking.msw_reads_free
        self.free.restype, self.free.argtypes = None, [ctypes.c_void_p]
        self.read_now = blocking.msw_read_now
        self.read_now.restype, self.read_now.argtypes = ctypes.c_int, [job_p]
        self.submit = quick.msw_reads_submit
        self.submit.restype, self.submit.argtypes = None, [ctypes.c_void_p, job_p, ctypes.c_int]
        self.submit_many = quick.msw_reads_submit_many
        self.submit_many.restype = None
        self.submit_many.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        self.cancel = quick.msw_reads_cancel
        self.cancel.restype, self.cancel.argtypes = ctypes.c_int, [ctypes.c_void_p, job_p]
        self.done = quick.msw_reads_done
        self.done.restype, self.done.argtypes = ctypes.c_int, [job_p]
        # for C that submits and waits itself (the native decode step's reads ahead): the functions' addresses
        self.addresses = {name: ctypes.cast(getattr(blocking, name), ctypes.c_void_p).value
                          for name in ("msw_reads_submit", "msw_reads_wait")}


def compiled_job(lib: ctypes.CDLL) -> tuple[list[tuple[str, int, int, str]], int, list[tuple[str, int]]]:
    """msw_job as the reader library `lib` was compiled: (name, offset, size, C type) per field, its size, and
    its states (name, value) in order."""
    lib.msw_job_size.restype, lib.msw_job_size.argtypes = ctypes.c_int64, []
    i64, text = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_char_p)
    lib.msw_job_field.restype, lib.msw_job_field.argtypes = ctypes.c_int, [ctypes.c_int64, text, i64, i64, text]
    lib.msw_job_state.restype, lib.msw_job_state.argtypes = ctypes.c_int, [ctypes.c_int64, text]
    fields: list[tuple[str, int, int, str]] = []
    states: list[tuple[str, int]] = []
    name, ctype, offset, size = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()
    while not lib.msw_job_field(len(fields), name, offset, size, ctype):
        fields.append(((name.value or b"").decode(), offset.value, size.value, (ctype.value or b"").decode()))
    while not lib.msw_job_state(len(states), name):
        states.append(((name.value or b"").decode(), len(states)))
    return fields, lib.msw_job_size(), states


def layout_problem(lib: ctypes.CDLL) -> str | None:
    """None when ReadJob and the job states as expert_read.h gives them are the reader library's, field for
    field and state for state; else a sentence naming the first difference."""
    fields, size, states = compiled_job(lib)
    return (struct_problem("msw_job", fields, size, ReadJob)
            or list_problem("MSW_JOB_STATES", job_abi().states, states))


def native_library() -> _Native | None:
    """The compiled reader, or None where it cannot be built (a warning says why, once)."""
    with _lib_lock:
        if not _lib:
            from moeswap.ops.native_build import build

            try:
                lib = _Native(str(build("native_reads", [SOURCE], [HEADER], flags=())))
            except (OSError, RuntimeError, AttributeError) as err:
                warnings.warn(f"moeswap: native expert reader unavailable, reading on Python threads: {err}",
                              RuntimeWarning, stacklevel=3)
                lib = None
            _lib.append(lib)
        return _lib[0]


_templates: dict[Checks, tuple[bytes, int]] = {}  # a job with these checks filled in, and their end


class Direct(NamedTuple):
    """How a read may go by O_DIRECT: a descriptor of the file opened with O_DIRECT, and the room the buffer has
    around the expert's bytes (`direct_layout`)."""

    fd: int
    head: int
    tail: int


def direct_layout(raw: torch.Tensor, offset: int, nbytes: int) -> tuple[torch.Tensor, int, int]:
    """The slice of `raw` (a uint8 buffer of nbytes + DIRECT_SLACK) where an O_DIRECT read of the aligned superset
    of [offset, offset + nbytes) puts the expert's bytes, and the room before and after that slice: the bytes land
    where they are used, no copy."""
    ptr = raw.data_ptr()
    at = -ptr % DIRECT_ALIGN + offset % DIRECT_ALIGN  # dst - ptr: (dst - offset's misalignment) aligned
    return raw[at:at + nbytes], at, raw.numel() - at - nbytes


def _set_direct(job: ReadJob, direct: Direct | None) -> None:
    if direct is not None:
        job.direct_fd1, job.align, job.head, job.tail = direct.fd + 1, DIRECT_ALIGN, direct.head, direct.tail


def read_job(fd: int, offset: int, buf: torch.Tensor, drop: bool, checks: Checks | None,
             direct: Direct | None = None) -> ReadJob:
    """A job that fills `buf` from `offset` of `fd` (by O_DIRECT where `direct` says how) and checks `checks`
    (what the reader threads, msw_read_now and the native decode step's in-call loads run)."""
    nbytes = buf.numel()
    if checks is None:
        job = ReadJob(fd, offset, nbytes, buf.data_ptr(), int(drop))
        _set_direct(job, direct)
        return job
    template = _templates.get(checks)
    if template is None:  # every expert of a model has the same checks: fill them in once (per load: a copy)
        if len(checks.ranges) > _CHECKS:
            raise ValueError(f"at most {_CHECKS} checked ranges per read, got {len(checks.ranges)}")
        job = ReadJob()
        for i, (o, n) in enumerate(checks.ranges):
            if o < 0 or n < 0:
                raise ValueError(f"checked range ({o}, {n}) must not be negative")
            job.check_off[i], job.check_len[i] = o, n
        job.nchecks, job.check_max = len(checks.ranges), checks.max_byte
        template = _templates[checks] = (bytes(job), max((o + n for o, n in checks.ranges), default=0))
    if template[1] > nbytes:
        raise ValueError(f"checked ranges end at byte {template[1]}, outside a buffer of {nbytes} bytes")
    job = ReadJob.from_buffer_copy(template[0])
    job.fd, job.offset, job.nbytes, job.dst, job.drop = fd, offset, nbytes, buf.data_ptr(), int(drop)
    _set_direct(job, direct)
    return job


def read_now(fd: int, offset: int, buf: torch.Tensor, checks: Checks | None = None, direct: Direct | None = None,
             log: ReadLog | None = None) -> bool | None:
    """Fill `buf` from `offset` of `fd` on this thread (OSError if the file ends first or the read
    fails); returns whether a checked byte is over its limit (None: not checked, no native reader).
    direct: by O_DIRECT where the file system allows; log: told of the read."""
    lib = native_library() if checks is not None or direct is not None or log is not None else None
    if lib is None:
        t0 = time.monotonic_ns()
        pread_exactly(fd, buf, offset)
        if log is not None:
            log.read(t0, time.monotonic_ns(), buf.numel(), 0)
        return None
    job = read_job(fd, offset, buf, False, checks, direct)
    error = lib.read_now(job)
    if log is not None:
        log.read(job.t0_ns, job.t1_ns, job.nbytes, job.direct)
    if error == -1:
        raise OSError(f"file shrank since open: expected {job.nbytes} bytes at offset {offset}")
    if error:
        raise OSError(error, os.strerror(error))
    return bool(job.bad)


Segment = tuple[int, int, torch.Tensor]  # (file descriptor, offset, uint8 CPU buffer to fill completely)


def pread_exactly(fd: int, buf: torch.Tensor, offset: int) -> None:
    """Fill the uint8 CPU tensor `buf` from `offset` of `fd`; OSError if the file ends first."""
    done = pread_into(fd, memoryview(buf.numpy()), offset)
    if done < buf.numel():
        raise OSError(f"file shrank since open: expected {buf.numel()} bytes at offset {offset}, got {done}")


# (the read's error or None, whether a checked byte was over its limit: None when not checked) -> the loaded
# value, or raises
Finish = Callable[[OSError | None, bool | None], object]


class Pending:
    def ready(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def result(self):
        raise NotImplementedError

    def cancel(self) -> bool:
        """True when it had not started and now never will."""
        raise NotImplementedError


class Done(Pending):
    """Already loaded (e.g. found in a host tier)."""

    def __init__(self, value):
        self.value = value

    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def result(self):
        return self.value

    def cancel(self) -> bool:
        return False


class _NativeRead(Pending):
    """One read's jobs on the native threads. `submit=False`: the caller submits them (read_many)."""

    def __init__(self, reads: Reads, segments: Sequence[Segment], drop: bool, urgent: bool, finish: Finish,
                 checks: Checks | None = None, submit: bool = True, direct: Direct | None = None,
                 log: ReadLog | None = None):
        self._reads, self._finish, self._log = reads, finish, log
        self._buffers = [buf for _, _, buf in segments]  # kept alive while C writes into them
        if checks is not None and len(segments) != 1:
            raise ValueError("checked reads have one segment")
        self._checked = checks is not None
        if direct is not None and len(segments) != 1:
            raise ValueError("O_DIRECT reads have one segment")
        self._jobs = [read_job(fd, offset, buf, drop, checks, direct) for fd, offset, buf in segments]
        if submit:
            for job in self._jobs:
                reads._lib.submit(reads._handle, job, int(urgent))

    def ready(self) -> bool:
        # a plain read of each job's state: result() still goes through the C atomic load before the bytes
        jobs = self._jobs
        return jobs[0].state >= _DONE if len(jobs) == 1 else all(j.state >= _DONE for j in jobs)

    def wait(self) -> None:
        if self._reads._handle is None:  # closed: every job is done or cancelled
            return
        for job in self._jobs:
            if not self._reads._lib.done(job):
                self._reads._lib.wait(self._reads._handle, job)  # ctypes drops the GIL meanwhile

    def result(self):
        self.wait()
        error = None
        for job in self._jobs:
            if job.state == _CANCELLED:
                error = OSError("the reader was closed before this read ran")
            elif job.error == -1:
                error = OSError(f"file shrank since open: expected {job.nbytes} bytes at offset {job.offset}")
            elif job.error:
                error = OSError(job.error, os.strerror(job.error))
            elif self._log is not None:
                self._log.read(job.t0_ns, job.t1_ns, job.nbytes, job.direct)
        bad = bool(self._jobs[0].bad) if self._checked and error is None else None
        return self._finish(error, bad)

    def cancel(self) -> bool:
        if self._reads._handle is None:
            return False
        removed = [bool(self._reads._lib.cancel(self._reads._handle, j)) for j in self._jobs]
        if all(removed):
            return True
        for job, gone in zip(self._jobs, removed):  # a few started: re-queue the rest (rare; keeps it simple)
            if gone:
                self._reads._lib.submit(self._reads._handle, job, 0)
        return False

    def __del__(self):  # never free memory a reader thread may still write into
        if not self.ready() and not self.cancel():
            self.wait()


class _Call(Pending):
    """`fn` on a pool thread; `finish(value, error)` makes the result on the thread that asks for it."""

    def __init__(self, fn: Callable[[], object], finish: Callable[[object, BaseException | None], object],
                 pool: _Pool):
        self.fn, self._finish, self._pool = fn, finish, pool
        self.done = threading.Event()
        self.value = self.error = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as err:  # handed to whoever takes the result
            self.error = err
        self.done.set()

    def ready(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        if self._pool.remove(self):  # still queued: run it here at once rather than behind others
            self.run()
        self.done.wait()

    def result(self):
        self.wait()
        return self._finish(self.value, self.error)

    def cancel(self) -> bool:
        return self._pool.remove(self)


class _Pool:
    """Python threads for `Reads.call`, started on first use."""

    def __init__(self, threads: int):
        self.threads = threads
        self._urgent: deque[_Call] = deque()
        self._normal: deque[_Call] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._workers: list[threading.Thread] = []

    def submit(self, call: _Call, urgent: bool) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("the expert reader is closed")
            if not self._workers:
                self._workers = [threading.Thread(target=self._work, name=f"moeswap-read-{i}", daemon=True)
                                 for i in range(self.threads)]
                for t in self._workers:
                    t.start()
            (self._urgent if urgent else self._normal).append(call)
            self._wake.notify()

    def remove(self, call: _Call) -> bool:
        with self._wake:
            for q in (self._urgent, self._normal):
                if call in q:
                    q.remove(call)
                    return True
        return False

    def close(self) -> None:
        with self._wake:
            self._closed = True
            dropped = [*self._urgent, *self._normal]
            self._urgent.clear()
            self._normal.clear()
            self._wake.notify_all()
        for call in dropped:
            call.error = OSError("the reader was closed before this read ran")
            call.done.set()
        for t in self._workers:
            t.join()

    def _work(self) -> None:
        while True:
            with self._wake:
                while not (self._closed or self._urgent or self._normal):
                    self._wake.wait()
                if self._closed:
                    return
                call = (self._urgent or self._normal).popleft()
            call.run()


class Reads:
    """`threads` reads in flight at once. native=False (or a machine without a C compiler) reads on
    Python threads instead."""

    def __init__(self, threads: int = DEFAULT_THREADS, native: bool = True):
        if threads < 1:
            raise ValueError(f"reader threads must be at least 1, got {threads}")
        self._lib = native_library() if native else None
        self._handle = self._lib.new(threads) if self._lib is not None else None
        if self._lib is not None and not self._handle:
            raise MemoryError("cannot start the native expert reader")
        self._pool = _Pool(threads)

    @property
    def native(self) -> bool:
        return self._handle is not None

    def entry_points(self) -> tuple[int, int, int] | None:
        """(reader handle, msw_reads_submit, msw_reads_wait) as addresses, for C that submits jobs and waits for
        them itself; None without the native reader."""
        if not self.native:
            return None
        return self._handle, self._lib.addresses["msw_reads_submit"], self._lib.addresses["msw_reads_wait"]

    def read(self, segments: Sequence[Segment], finish: Finish, drop: bool = False, urgent: bool = False,
             checks: Checks | None = None, direct: Direct | None = None, log: ReadLog | None = None) -> Pending:
        """Fill each segment's buffer from its file; `result()` returns finish(error or None, bad), bad saying
        whether a byte in `checks` (one segment's) is over its limit, None where not checked (the Python
        threads do not check: the caller does). drop: then drop those pages from the OS page cache. direct: one
        segment read by O_DIRECT where the file system allows (the native threads only). log: told of each
        read when its result is taken."""
        if self.native:
            return _NativeRead(self, segments, drop, urgent, finish, checks, direct=direct, log=log)
        times: list[tuple[int, int, int]] = []

        def read_all() -> None:
            for fd, offset, buf in segments:
                t0 = time.monotonic_ns()
                pread_exactly(fd, buf, offset)
                if drop and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, offset, buf.numel(), os.POSIX_FADV_DONTNEED)
                times.append((t0, time.monotonic_ns(), buf.numel()))

        def finish_call(_, error):
            if error is not None and not isinstance(error, OSError):
                raise error
            if log is not None:
                for t0, t1, n in times:
                    log.read(t0, t1, n, 0)
            return finish(error, None)

        call = _Call(read_all, finish_call, self._pool)
        self._pool.submit(call, urgent)
        return call

    def read_many(self, reads: Sequence[tuple], drop: bool = False, urgent: bool = False,
                  log: ReadLog | None = None) -> list[Pending]:
        """`read` for each (segments, finish, checks) or (segments, finish, checks, direct), submitted to the
        native threads in one call and in this order (a layer step's loads)."""
        if not self.native:
            return [self.read(r[0], r[1], drop, urgent, r[2], log=log) for r in reads]
        pending = [_NativeRead(self, r[0], drop, urgent, r[1], r[2], submit=False,
                               direct=r[3] if len(r) > 3 else None, log=log) for r in reads]
        jobs = [ctypes.addressof(job) for p in pending for job in p._jobs]
        if jobs:
            self._lib.submit_many(self._handle, (ctypes.c_void_p * len(jobs))(*jobs), len(jobs), int(urgent))
        return pending

    def call(self, fn: Callable[[], object], urgent: bool = False) -> Pending:
        """fn() on a Python thread; `result()` returns its value or raises its error."""

        def finish(value, error):
            if error is not None:
                raise error
            return value

        call = _Call(fn, finish, self._pool)
        self._pool.submit(call, urgent)
        return call

    def close(self) -> None:
        """Waits for reads in progress; queued ones are dropped (their result() raises)."""
        self._pool.close()
        if self._handle is not None:
            self._lib.free(self._handle)
            self._handle = None
