"""How the store reads routed experts from the checkpoint, as the load options name it (torch-free, for
options.py): EXPERT_READS (--expert-reads; experts/tiers.py CheckpointTier says what each does) and the reader
threads' default count (--read-threads; experts/reads.py runs them)."""

EXPERT_READS = ("auto", "direct", "buffered")
# reads in flight: more threads read faster, and decode gained nothing past 2 (docs/benchmarks.md)
DEFAULT_THREADS = 2
