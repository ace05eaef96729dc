"""moeswap: run, swap, serve, fine-tune and plan Kimi K3-class mixture-of-experts models.

Importing it changes nothing in the process; the `moeswap` command tunes the process it runs in
(huge pages, the allocator) through `moeswap.tuning.tune_process()`, which a library user may call too.
"""

__version__ = "0.1.0"
