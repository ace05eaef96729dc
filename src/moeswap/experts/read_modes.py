"""How the store reads routed experts from the checkpoint, as the load options name it (torch-free, for
options.py): EXPERT_READS (--expert-reads; experts/tiers.py CheckpointTier says what each does) and the reader
threads' default count (--read-threads; experts/reads.py runs them)."""

EXPERT_READS = ("auto", "direct", "buffered")
# reads in flight: 4 read K3-sized experts 6% faster than 2 by O_DIRECT and no slower past (docs/benchmarks.md,
# "Experts from disk"); idle ones cost nothing
DEFAULT_THREADS = 4
