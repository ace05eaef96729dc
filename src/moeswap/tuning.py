"""Process-wide tuning for a moeswap process: nothing here runs on import, only when called.

The `moeswap` command (cli.main) and the benchmark child processes call `tune_process()` first, before
torch is imported; a program that imports moeswap as a library decides for itself (call it, or set the
same knobs its own way). Entry point: `tune_process()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import time
from dataclasses import dataclass

# MOESWAP_THREADS=auto (default) fits the OpenMP threads to the machine's load; "spin" keeps OpenMP's own
# defaults (one thread per core, spin-waiting), for A/B runs (bench load) and quiet dedicated machines.
ENV_THREADS = "MOESWAP_THREADS"
THREAD_MODES = ("auto", "spin")
OPENMP_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # the user's settings, which win


@dataclass(frozen=True)
class ThreadFit:
    """What `fit_threads_to_load` decided, and from what (generate --stats prints it)."""

    cores: int  # CPUs this process may run on
    load: float  # other processes' demand for CPUs when this one started (other_load)
    threads: int | None  # OMP_NUM_THREADS set here; None: left as it was
    passive: bool  # OMP_WAIT_POLICY=PASSIVE set here
    why: str

    def summary(self) -> str:
        threads = "OpenMP defaults" if self.threads is None else f"{self.threads} thread(s)"
        return f"{threads}{', passive wait' if self.passive else ''} ({self.why})"


last_fit: ThreadFit | None = None
_tuned = False  # tune_process ran in this process (it runs once)


def tune_process() -> None:
    """Huge pages for torch's large CPU allocations, large frees returned to the OS, and OpenMP threads
    fitted to the machine's load; once per process (later calls do nothing). The variables only count
    before torch (and its OpenMP runtime, which reads them when it loads) is imported; in a process that
    already has torch, the allocator is tuned and torch's threads lowered (fit_torch_threads), but huge pages
    and the passive wait are out of reach."""
    global last_fit, _tuned
    if _tuned:
        return
    _tuned = True
    return_large_frees_to_os()
    if "torch" in sys.modules:
        last_fit = fit_torch_threads()
        return
    use_huge_pages()
    last_fit = fit_threads_to_load()


def fit_torch_threads(cores: int | None = None, load: float | None = None) -> ThreadFit:
    """fit_threads_to_load for a process whose OpenMP runtime has started (torch imported): its threads are
    lowered with torch.set_num_threads (the C kernels take torch's count too), never raised; the wait policy
    is fixed by then, so the remaining threads still spin between regions. The environment is left as it is."""
    import torch

    fit = fit_threads_to_load(cores, load, dict(os.environ))
    if fit.threads is None:
        return fit
    if fit.threads < torch.get_num_threads():
        torch.set_num_threads(fit.threads)
    return ThreadFit(fit.cores, fit.load, torch.get_num_threads(), False,
                     f"{fit.why}; torch was imported first, so OpenMP keeps spin-waiting")


def fit_threads_to_load(cores: int | None = None, load: float | None = None,
                        environ: dict | None = None) -> ThreadFit:
    """Fewer OpenMP threads, waiting passively, when other processes already keep the cores busy.

    torch and the C kernels share one OpenMP runtime (torch's libgomp), whose threads spin after every
    parallel region. When other processes hold the cores, a region's join waits for a worker the kernel
    has descheduled, and the spinning threads take the time that worker needs (docs/benchmarks.md). So, with other processes'
    load L (other_load) on C cores, the threads are the cores left free, round(C - L), at least 1, waiting
    passively; when that is every core (L < 1/2) OpenMP keeps its defaults. A variable the
    user set (OMP_NUM_THREADS, OMP_WAIT_POLICY, GOMP_SPINCOUNT) wins; MOESWAP_THREADS=spin turns this off.
    Must run before the OpenMP runtime starts (before torch is imported): it only sets variables."""
    env = os.environ if environ is None else environ
    cores = cores if cores is not None else _cores()
    if load is None:
        load = other_load()
    mode = env.get(ENV_THREADS, "auto")
    if mode not in THREAD_MODES:
        raise ValueError(f"{ENV_THREADS}={mode!r}: expected one of {', '.join(THREAD_MODES)}")
    if mode == "spin":
        return ThreadFit(cores, load, None, False, f"{ENV_THREADS}=spin")
    user_set = [v for v in OPENMP_VARIABLES if v in env]
    if user_set:
        return ThreadFit(cores, load, None, False, f"{', '.join(user_set)} set by the user")
    threads = max(1, round(cores - load)) if math.isfinite(load) else cores
    if threads >= cores:
        return ThreadFit(cores, load, None, False, f"load {load:.1f} on {cores} cores")
    env["OMP_NUM_THREADS"] = str(threads)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return ThreadFit(cores, load, threads, True, f"load {load:.1f} on {cores} cores: busy machine")


def other_load(looks: int = 10, gap_s: float = 0.005) -> float:
    """Other processes' demand for CPUs now: the tasks runnable besides this one, the median of `looks`
    readings of /proc/loadavg's running count `gap_s` apart (50 ms by default). Not the 1-minute load
    average: it lags by a minute both ways, so it would take a load that just ended for a busy machine
    (and the reverse); it is the fallback where /proc/loadavg is missing."""
    seen = []
    for i in range(looks):
        try:
            with open("/proc/loadavg") as f:
                seen.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            break
        if i < looks - 1:
            time.sleep(gap_s)
    if seen:
        return float(sorted(seen)[len(seen) // 2])
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return 0.0


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def use_huge_pages() -> None:
    """Transparent huge pages for torch's CPU allocations of 2 MB and more (weights, caches): a decode
    step streams every weight once, and with 4 KB pages the page walks cost a CPU core a good share of its
    streaming rate (docs/benchmarks.md).
    A value the user set (THP_MEM_ALLOC_ENABLE=0 turns it off) wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


MMAP_THRESHOLD = 512 << 10  # inference: see return_large_frees_to_os
TRAIN_MMAP_THRESHOLD = 64 << 20  # training: see heap_for_training


def return_large_frees_to_os(threshold: int = MMAP_THRESHOLD) -> None:
    """Serve allocations >= threshold with mmap so freeing them returns memory to the OS (glibc only).

    Experts come and go in blocks of one buffer each (0.8 MB on the bench model, 17.5 MB on K3); glibc's
    default (a threshold that grows up to 32 MiB) keeps them in the heap, well above the store's budget, and
    1 MiB still more than 512 KiB (docs/benchmarks.md). The price, page
    faults on every fresh buffer, is avoided for disk reads by reusing buffers (experts/buffers.py).
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            pass  # not glibc: nothing to tune


@contextlib.contextmanager
def heap_for_training(threshold: int = TRAIN_MMAP_THRESHOLD):
    """Allocations below `threshold` from the heap while the block runs, then MMAP_THRESHOLD again.

    A training step's activations and the frozen-experts node's buffers (several MB each) are freed and
    allocated again every step: served by mmap, each is page-faulted afresh every step (docs/benchmarks.md);
    64 MiB also keeps longer rows' activations in the heap. The expert store's
    buffers are pooled (experts/buffers.py), so the heap growth the inference threshold guards against does
    not come from them.
    """
    return_large_frees_to_os(threshold)
    try:
        yield
    finally:
        return_large_frees_to_os()
