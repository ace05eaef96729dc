"""Raw expert-read rate of the store's reader (experts/reads.py) at K3's expert size: steps of K random experts
of E bytes (flat routing) from FILE, each step's reads submitted together in file-offset order to N reader
threads, by O_DIRECT (`direct`) or buffered and cold (`buffered`: pread, then POSIX_FADV_DONTNEED, as the
reader's fallback); the page cache is dropped before each run (root). docs/benchmarks.md, "Experts from disk at
the drive's speed", has the numbers.

    dd if=/dev/zero of=/tmp/stream-raw.bin bs=16M count=256 conv=fsync
    python scripts/expert_reads.py /tmp/stream-raw.bin buffered,direct 1,2,4,8
"""

import os
import random
import subprocess
import sys
import time

import torch

from moeswap.experts.reads import DIRECT_SLACK, Direct, Reads, direct_layout
from moeswap.experts.stats import ReadStats

E, K, STEPS = 17_550_000, 8, 24  # K3: 17.55 MB an MXFP4 expert, top-8


def main(path: str, modes: str, thread_counts: str) -> None:
    slots = os.path.getsize(path) // E - 1
    rng = random.Random(0)
    plan = [sorted(rng.sample(range(slots), K)) for _ in range(STEPS)]
    fd, dfd = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [torch.zeros(E + DIRECT_SLACK, dtype=torch.uint8) for _ in range(K)]
    for mode in modes.split(","):
        for threads in [int(t) for t in thread_counts.split(",")]:
            subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
            reads, log = Reads(threads), ReadStats()
            t0 = time.perf_counter()
            for step in plan:
                jobs = []
                for i, slot in enumerate(step):
                    offset = slot * E + 1234  # experts are not block-aligned in a safetensors file
                    buf, head, tail = direct_layout(bufs[i], offset, E)
                    jobs.append(([(fd, offset, buf)], lambda e, bad: e, None,
                                 Direct(dfd, head, tail) if mode == "direct" else None))
                for pending in reads.read_many(jobs, drop=mode == "buffered", urgent=True, log=log):
                    error = pending.result()
                    if error is not None:
                        raise error
            dt = time.perf_counter() - t0
            log.merge()
            print(f"{mode:8s} threads {threads}: {log.bytes / 1e9:.2f} GB in {dt:.2f} s = {log.bytes / dt / 1e9:.2f} "
                  f"GB/s (in flight {log.bytes / log.busy_s / 1e9:.2f}), O_DIRECT {log.direct_reads}/{log.reads}",
                  flush=True)
            reads.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
