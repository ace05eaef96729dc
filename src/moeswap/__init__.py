"""moeswap: run, swap, serve, fine-tune and plan Kimi K3-class mixture-of-experts models."""

import os as _os

__version__ = "0.1.0"

# Transparent huge pages for torch's CPU allocations of 2 MB and more (weights, caches, expert buffers):
# a decode step streams every weight once, and with 4 KB pages the page walks cost a CPU core about a
# third of its streaming rate (measured on the bench VM: one core's bf16_linear 17 -> 25 GB/s). Set
# before torch allocates; a value the user set (0 to turn it off) wins. docs/benchmarks.md has numbers.
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
