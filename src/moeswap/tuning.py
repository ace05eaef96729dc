"""Process-wide tuning for a moeswap process: nothing here runs on import, only when called.

The `moeswap` command (cli.main) and the benchmark child processes call `tune_process()` first; a
program that imports moeswap as a library decides for itself (call it, or set the same knobs its own way).
Entry point: `tune_process()`.
"""

from __future__ import annotations

import ctypes
import os
import sys


def tune_process() -> None:
    """Huge pages for torch's large CPU allocations, and large frees returned to the OS. Call it before
    loading a model (torch reads THP_MEM_ALLOC_ENABLE at its first large allocation)."""
    use_huge_pages()
    return_large_frees_to_os()


def use_huge_pages() -> None:
    """Transparent huge pages for torch's CPU allocations of 2 MB and more (weights, caches): a decode
    step streams every weight once, and with 4 KB pages the page walks cost a CPU core about a third of
    its streaming rate (measured on the bench VM: one core's bf16_linear 17 -> 25 GB/s; docs/benchmarks.md).
    A value the user set (THP_MEM_ALLOC_ENABLE=0 turns it off) wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def return_large_frees_to_os(threshold: int = 512 << 10) -> None:
    """Serve allocations >= threshold with mmap so freeing them returns memory to the OS (glibc only).

    Experts come and go in blocks of one buffer each (0.8 MB on the bench model, 17.5 MB on K3); glibc's
    default (a threshold that grows up to 32 MiB) keeps them in the heap, which measured ~500 MB above
    budget on a 1.2 GB-expert model, and 1 MiB still 110-250 MB more than 512 KiB. The price, page
    faults on every fresh buffer, is avoided for disk reads by reusing buffers (experts/buffers.py).
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # -3 = M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            pass  # not glibc: nothing to tune
