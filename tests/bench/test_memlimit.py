"""bench/memlimit.py: a run confined to a memory cgroup is killed when its anonymous memory passes the limit,
its page cache is charged to the limit (a file twice the limit is read under it), an unsettable limit is a
one-line error; the page-cache drop's refusal is one line; the read-ceiling probe reads what it says.

The cgroup tests need a memory controller this process may make a child cgroup in (root, or a delegated
cgroup v2): elsewhere they are skipped with the reason memory_cgroup gave."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from moeswap.bench import memlimit
from moeswap.bench.memlimit import MemoryLimitError, call_limited, drop_caches, memory_cgroup, read_ceiling, run_limited

MiB = 1 << 20
LIMIT = 64 * MiB


@pytest.fixture(scope="module")
def cgroups():
    try:
        with memory_cgroup(LIMIT) as cg:
            assert cg.path.is_dir()
            made = cg.path
    except MemoryLimitError as err:
        pytest.skip(f"no memory cgroup can be made here: {err}")
    assert not made.exists()  # removed after use


def touch_twice_the_limit() -> int:
    data = b"\x01" * (2 * LIMIT)  # written, so every page is charged
    return len(data)


def test_anonymous_memory_past_the_limit_is_killed(cgroups):
    got = call_limited(touch_twice_the_limit, LIMIT)
    assert got.oom_killed and got.returncode == -signal.SIGKILL and got.value is None
    assert got.peak_bytes is None or got.peak_bytes <= LIMIT


def test_memory_under_the_limit_runs_and_returns(cgroups):
    got = call_limited(lambda: len(b"\x01" * (LIMIT // 4)), LIMIT)
    assert (got.returncode, got.oom_killed, got.value) == (0, False, LIMIT // 4)


def test_page_cache_is_charged(cgroups, tmp_path):
    """A file twice the limit read under it: the run succeeds, and its high-water mark reaches the limit's
    range though cat itself needs ~1 MiB: the cache of what it read was charged, and reclaimed at the limit."""
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.write(os.urandom(MiB) * (2 * LIMIT // MiB))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # not cached (charged elsewhere) before
    got = run_limited(["cat", str(path)], LIMIT, stdout=subprocess.DEVNULL)
    assert (got.returncode, got.oom_killed) == (0, False)
    if got.peak_bytes is None:
        pytest.skip("this kernel keeps no cgroup high-water mark (cgroup v2 memory.peak needs Linux 5.19)")
    assert LIMIT // 2 < got.peak_bytes <= LIMIT


def test_unsettable_limit_is_one_line(tmp_path):
    fake = tmp_path / "cgroup"
    (fake / "memory").mkdir(parents=True)  # a v1 layout without the memory controller's files
    with pytest.raises(MemoryLimitError) as err:
        with memory_cgroup(LIMIT, root=fake):
            pass
    assert str(err.value) == (f"cannot set a memory limit: no memory cgroup controller under {fake} (neither "
                              "cgroup v2 memory.max nor v1 memory.limit_in_bytes)")
    with pytest.raises(MemoryLimitError, match=r"^cannot set a memory limit: 0 bytes is not a limit$"):
        run_limited(["true"], 0, root=fake)


def test_drop_caches_refused_is_one_line(tmp_path):
    where = tmp_path / "no" / "drop_caches"
    with pytest.raises(MemoryLimitError, match=rf"^cannot drop the page cache: writing 3 to {where} failed: "):
        drop_caches(where)


@pytest.mark.parametrize("direct", [True, False])
def test_read_ceiling_reads_what_it_reports(tmp_path, monkeypatch, direct):
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    block = 3 * 65536 + 1000  # not a multiple of a page: the unaligned offsets of real expert blocks
    path = tmp_path / "f"
    path.write_bytes(os.urandom(block) * 4)
    got = read_ceiling(path, block=block, random_reads=5)
    assert got.sequential_bytes == 4 * block and got.block == block
    # each random read covers its block from the page boundary below, in whole pages (short at the end)
    assert 5 * block <= got.random_bytes <= 5 * (block + 2 * 4096)
    buffered = "buffered after POSIX_FADV_DONTNEED (O_DIRECT refused)"
    assert got.how in ("O_DIRECT", buffered) if direct else got.how == buffered


def test_read_ceiling_needs_a_block(tmp_path):
    path = tmp_path / "small"
    path.write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="less than one 17547264-byte block"):
        read_ceiling(path)
    assert memlimit.EXPERT_BYTES == 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)

