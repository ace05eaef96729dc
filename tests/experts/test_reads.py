"""Reads: background byte-range reads on native threads (and the Python-thread fallback): the bytes land
where asked, errors reach the caller's finish, queued reads can be cancelled, close never hangs."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from moeswap.experts.reads import Reads, native_library

MODES = [pytest.param(True, id="native"), pytest.param(False, id="python")]


@pytest.fixture
def data_file(tmp_path):
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "blob.bin"
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def make_reads(native: bool, threads: int = 2) -> Reads:
    if native and native_library() is None:
        pytest.skip("the native reader does not build here")
    reads = Reads(threads, native)
    assert reads.native == native
    return reads


def held_reader(native: bool):
    """A one-thread reader whose Python thread (the fallback's only reader) is busy until `gate` is set,
    returned once that thread is in the blocking call (on a busy machine it may start late, and a close
    before then would drop the blocker itself)."""
    reads = make_reads(native, threads=1)
    gate, started = threading.Event(), threading.Event()
    blocker = reads.call(lambda: started.set() or gate.wait())
    assert started.wait(30), "the reader thread never ran the blocking call"
    return reads, gate, blocker


@pytest.mark.parametrize("native", MODES)
def test_segments_are_filled_from_their_offsets(data_file, native):
    fd, data = data_file
    reads = make_reads(native)
    try:
        jobs = []
        for i in range(12):
            bufs = [torch.zeros(1000 + 37 * i, dtype=torch.uint8), torch.zeros(5000, dtype=torch.uint8)]
            offsets = [4096 * i + 3, 2_000_000 + 11 * i]
            pending = reads.read(list(zip([fd, fd], offsets, bufs)), finish=lambda err, bad, b=bufs: (err, b),
                                 urgent=i % 3 == 0, drop=i % 2 == 0)
            jobs.append((offsets, pending))
        for offsets, pending in jobs:
            err, bufs = pending.result()
            assert err is None and pending.ready()
            for off, buf in zip(offsets, bufs):
                assert torch.equal(buf, data[off : off + buf.numel()])
    finally:
        reads.close()


@pytest.mark.parametrize("native", MODES)
def test_a_read_past_the_end_reaches_finish_as_an_error(data_file, native):
    fd, data = data_file
    reads = make_reads(native)
    try:
        buf = torch.zeros(100, dtype=torch.uint8)
        err = reads.read([(fd, data.numel() - 10, buf)], finish=lambda e, bad: e).result()
        assert isinstance(err, OSError) and "shrank" in str(err)
        err = reads.read([(-1, 0, buf)], finish=lambda e, bad: e).result()  # a bad descriptor: errno's message
        assert isinstance(err, OSError) and "Bad file descriptor" in str(err)
    finally:
        reads.close()


@pytest.mark.parametrize("native", MODES)
def test_cancelled_reads_never_write_and_the_rest_complete(data_file, native):
    fd, data = data_file
    reads, gate, blocker = held_reader(native)
    try:
        bufs = [torch.full((1 << 20,), 7, dtype=torch.uint8) for _ in range(40)]
        pendings = [reads.read([(fd, 4096 * i, b)], finish=lambda e, bad: e) for i, b in enumerate(bufs)]
        cancelled = [p.cancel() for p in reversed(pendings)][::-1]
        gate.set()
        blocker.result()
        assert any(cancelled)
        for i, (p, b, gone) in enumerate(zip(pendings, bufs, cancelled)):
            if gone:
                assert bool((b == 7).all()), i
            else:
                assert p.result() is None and torch.equal(b, data[4096 * i : 4096 * i + b.numel()])
    finally:
        reads.close()


@pytest.mark.parametrize("native", MODES)
def test_close_drops_queued_reads_with_an_error(data_file, native):
    fd, _ = data_file
    reads, gate, blocker = held_reader(native)
    pendings = [reads.read([(fd, 0, torch.empty(1 << 20, dtype=torch.uint8))], finish=lambda e, bad: e)
                for _ in range(30)]
    threading.Timer(0.05, gate.set).start()
    reads.close()
    blocker.result()
    results = [p.result() for p in pendings]  # none hangs
    assert all(r is None or "closed" in str(r) for r in results)
    if not native:  # the Python reader was held by the blocker: everything queued was dropped
        assert all(isinstance(r, OSError) for r in results)


def test_call_returns_values_and_raises_errors():
    reads = Reads(1, native=False)
    try:
        assert reads.call(lambda: 42).result() == 42

        def boom():
            raise ValueError("bad expert")

        with pytest.raises(ValueError, match="bad expert"):
            reads.call(boom).result()
        with pytest.raises(ValueError, match="at least 1"):
            Reads(0)
    finally:
        reads.close()
