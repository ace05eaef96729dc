"""Benchmark runs confined to a memory limit that counts the page cache, a clean page cache, and the drive's
read ceiling: what a streaming benchmark needs so that "the model does not fit in memory" is true of the run
and not only of the machine (a file read through the page cache is charged to the reader's memory cgroup).

The limit is a memory cgroup made for the run, a child of this process's own cgroup: cgroup v2 `memory.max`
(with `memory.swap.max` 0) where this process's cgroup can have children with the memory controller, else
cgroup v1 `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` where swap accounting exists). The child
process joins it before it runs anything (between fork and exec) and the cgroup is removed after it exits.
Where neither can be set, `MemoryLimitError` says why in one line.

Entry points: `run_limited(argv, limit)` and `call_limited(fn, limit)` (a callable in a forked child),
`memory_cgroup(limit)` (the cgroup as a context manager), `drop_caches()`, `read_ceiling(path)`.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import multiprocessing
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
EXPERT_BYTES = 17_547_264  # one Kimi K3 routed expert: 3 x (3072 x 3584 MXFP4 codes + a scale byte per 32)
_counter = itertools.count()


class MemoryLimitError(ValueError):
    """No memory limit can be set (or the page cache cannot be dropped) here. A ValueError, so that the CLI
    says it in one line and exits 2, as for a bad flag: the run cannot go ahead as it was asked for."""


@dataclass(frozen=True)
class Limited:
    """How a confined run ended. peak_bytes: the cgroup's high-water mark of memory charged (anonymous memory
    and page cache), None where the kernel does not keep one (cgroup v2 before Linux 5.19)."""

    returncode: int
    oom_killed: bool
    peak_bytes: int | None
    limit_bytes: int
    version: int  # the cgroup version that enforced the limit
    value: Any = None  # call_limited: what the callable returned


class MemoryCgroup:
    """A memory cgroup made for one run (`memory_cgroup` makes and removes it). `procs` is the file a pid is
    written to to move that process in."""

    def __init__(self, path: Path, version: int, limit: int):
        self.path, self.version, self.limit = path, version, limit

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def join(self, pid: int = 0) -> None:
        """Moves process `pid` (0: the caller) into the cgroup."""
        with open(self.procs, "w") as f:
            f.write(str(pid or os.getpid()))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes of the cgroup the kernel killed for its limit ("oom_kill" in memory.oom_control (v1) or
        memory.events (v2)); -1 where the kernel does not count them."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            fields = dict(line.split() for line in (self.path / name).read_text().splitlines() if line.strip())
        except OSError:
            return -1
        return int(fields.get("oom_kill", -1))


def _own_cgroup(root: Path, version: int) -> Path:
    """This process's cgroup directory in the hierarchy mounted at `root` (the root where it cannot be told)."""
    want = "" if version == 2 else "memory"
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (version == 2 and controllers == "") or (version == 1 and want in controllers.split(",")):
                own = root / path.lstrip("/")
                if own.is_dir():
                    return own
    except OSError:
        pass
    return root


def _hierarchy(root: Path) -> tuple[int, Path] | None:
    """(version, parent for a new cgroup) of the memory controller under `root`: v2 where `root` is a unified
    hierarchy offering memory, else v1 at root/memory; None where there is neither."""
    controllers = root / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split():
        return 2, _own_cgroup(root, 2)
    if (root / "memory" / "memory.limit_in_bytes").is_file():
        return 1, _own_cgroup(root / "memory", 1)
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@contextmanager
def memory_cgroup(limit_bytes: int, root: Path = CGROUP_ROOT) -> Iterator[MemoryCgroup]:
    """A new memory cgroup limited to `limit_bytes` (page cache included, swap excluded), removed on exit
    once its processes are gone."""
    if limit_bytes <= 0:
        raise MemoryLimitError(f"cannot set a memory limit: {limit_bytes} bytes is not a limit")
    found = _hierarchy(Path(root))
    if found is None:
        raise MemoryLimitError(f"cannot set a memory limit: no memory cgroup controller under {root} (neither "
                               f"cgroup v2 memory.max nor v1 memory.limit_in_bytes)")
    version, parent = found
    path = parent / f"moeswap-bench-{os.getpid()}-{next(_counter)}"
    try:
        path.mkdir()
    except OSError as err:
        raise MemoryLimitError(f"cannot set a memory limit: cannot create the cgroup {path}: "
                               f"{err.strerror or err} (run as root, or in a delegated cgroup)") from None
    try:
        try:
            if version == 2:
                if not (path / "memory.max").exists():  # the parent does not hand the controller down yet
                    _write(parent / "cgroup.subtree_control", "+memory")
                _write(path / "memory.max", str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    _write(path / "memory.swap.max", "0")
            else:
                _write(path / "memory.limit_in_bytes", str(limit_bytes))
                if (path / "memory.memsw.limit_in_bytes").exists():  # swap counted with memory: none beyond
                    _write(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
        except OSError as err:
            raise MemoryLimitError(f"cannot set a memory limit: writing the limit of {path} failed: "
                                   f"{err.strerror or err}") from None
        yield MemoryCgroup(path, version, limit_bytes)
    finally:
        _remove(path)


def _remove(path: Path) -> None:
    # rmdir fails while a process is still in it (EBUSY): its exit is reaped by then, but the kernel may lag
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as err:
            if err.errno != errno.EBUSY:
                raise
            time.sleep(0.01)
    path.rmdir()


def run_limited(argv: Sequence[str], limit_bytes: int, root: Path = CGROUP_ROOT, **popen: Any) -> Limited:
    """Runs the command `argv` to its end inside a new memory cgroup of `limit_bytes`."""
    with memory_cgroup(limit_bytes, root) as cg:
        # the child joins before exec, so that nothing it does runs outside the limit
        proc = subprocess.Popen(list(argv), preexec_fn=cg.join, **popen)
        code = proc.wait()
        return Limited(code, _killed(cg, code), cg.peak(), limit_bytes, cg.version)


def call_limited(fn: Callable[[], Any], limit_bytes: int, root: Path = CGROUP_ROOT) -> Limited:
    """Runs `fn()` in a forked child process inside a new memory cgroup of `limit_bytes`; `value` is what
    it returned (None when it was killed or raised: returncode then says which, 1 for an exception)."""
    ctx = multiprocessing.get_context("fork")
    with memory_cgroup(limit_bytes, root) as cg:
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(cg, fn, send), daemon=False)
        proc.start()
        send.close()
        try:
            value = receive.recv()
        except EOFError:  # the child died without answering (killed)
            value = None
        proc.join()
        receive.close()
        code = proc.exitcode if proc.exitcode is not None else -1
        return Limited(code, _killed(cg, code), cg.peak(), limit_bytes, cg.version, value)


def _child(cg: MemoryCgroup, fn: Callable[[], Any], send) -> None:
    cg.join()
    try:
        value = fn()
    except BaseException:
        send.close()
        raise
    send.send(value)
    send.close()


def _killed(cg: MemoryCgroup, code: int) -> bool:
    """The kernel killed the run for its limit: a kill the cgroup counted, or (kernels that count none) the
    run ended by SIGKILL, which nothing else here sends."""
    kills = cg.oom_kills()
    return kills > 0 if kills >= 0 else code == -signal.SIGKILL


def drop_caches(path: Path = Path("/proc/sys/vm/drop_caches")) -> None:
    """Writes dirty pages back, then drops the page cache, dentries and inodes (as `echo 3 >
    /proc/sys/vm/drop_caches`), so the next read of a file comes from the drive."""
    try:
        with open(path, "w") as f:  # opened first: a refusal is said at once, not after a long sync
            os.sync()
            f.write("3")
    except OSError as err:
        raise MemoryLimitError(f"cannot drop the page cache: writing 3 to {path} failed: {err.strerror or err} "
                               f"(needs root)") from None


@dataclass(frozen=True)
class ReadCeiling:
    """What reads of a file reach. sequential / random: GB/s (10^9 bytes a second); random reads are
    `block`-sized at `block`-aligned offsets (one K3 expert by default). `how` says whether O_DIRECT bypassed
    the page cache or buffered reads after POSIX_FADV_DONTNEED were used instead (O_DIRECT refused)."""

    sequential_gbps: float
    random_gbps: float
    block: int
    how: str
    sequential_bytes: int
    random_bytes: int
    threads: int = 1  # threads the random reads shared


def read_ceiling(path: str | os.PathLike, block: int = EXPERT_BYTES, sequential_bytes: int | None = None,
                 random_reads: int = 64, seed: int = 0, threads: int = 1) -> ReadCeiling:
    """Sequential reads of `path` from its start (all of it, or `sequential_bytes`), then `random_reads`
    reads of `block` bytes at random multiples of `block` (a file of at least one block), shared by `threads`
    threads reading at once (a drive's queue: what a store reading a step's misses on several threads gets)."""
    size = os.path.getsize(path)
    if size < block:
        raise ValueError(f"{path}: {size} bytes, less than one {block}-byte block to read")
    chunk = 8 << 20
    seq_total = min(size, sequential_bytes or size)
    direct = _open_direct(path)
    fd, how = (direct, "O_DIRECT") if direct is not None else (os.open(path, os.O_RDONLY), "buffered after "
                                                                "POSIX_FADV_DONTNEED (O_DIRECT refused)")
    # O_DIRECT needs aligned buffers, offsets and lengths: anonymous maps are page aligned; lengths are rounded
    # up to 4 KiB (a read past the end returns short)
    align = 4096
    bufs = [mmap.mmap(-1, max(chunk, _round_up(block, align) + align)) for _ in range(max(1, threads))]
    view = memoryview(bufs[0])
    try:
        _forget(fd, direct is None)
        start = time.perf_counter()
        done = 0
        while done < seq_total:
            n = os.preadv(fd, [view[:_round_up(min(chunk, seq_total - done), align)]], done)
            if n <= 0:
                break
            done += n
        seq_s = time.perf_counter() - start
        done = min(done, seq_total)
        _forget(fd, direct is None)
        rng = random.Random(seed)
        blocks = size // block
        offsets = [rng.randrange(blocks) * block for _ in range(random_reads)]

        def read_some(i: int) -> int:
            mine, got = memoryview(bufs[i]), 0
            try:
                for offset in offsets[i::len(bufs)]:
                    # an expert's offset is a multiple of 17.55 MB, not of 4 KiB: O_DIRECT reads from the 4 KiB
                    # boundary below and a whole number of pages, as a store reading experts with O_DIRECT must
                    lo = offset - offset % align
                    got += os.preadv(fd, [mine[:_round_up(offset + block - lo, align)]], lo)
            finally:
                mine.release()
            return got

        start = time.perf_counter()
        with ThreadPoolExecutor(len(bufs)) as pool:  # preadv drops the GIL while it reads
            got = sum(pool.map(read_some, range(len(bufs))))
        rand_s = time.perf_counter() - start
    finally:
        view.release()
        for buf in bufs:
            buf.close()
        os.close(fd)
    return ReadCeiling(done / seq_s / 1e9, got / rand_s / 1e9, block, how, done, got, len(bufs))


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _open_direct(path: str | os.PathLike) -> int | None:
    """An O_DIRECT descriptor of `path`, None where the platform or file system refuses one (tmpfs, ...)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    probe = mmap.mmap(-1, 4096)
    try:
        os.preadv(fd, [probe], 0)  # some file systems accept the flag and refuse the read
    except OSError:
        os.close(fd)
        return None
    finally:
        probe.close()
    return fd


def _forget(fd: int, buffered: bool) -> None:
    """Buffered reads only: ask the kernel to drop the file's cached pages so they are read from the drive."""
    if buffered and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
