"""Counters of the expert store: hits and misses per tier, bytes moved, time stalled, prefetch accuracy,
experts kept for backward passes, where hybrid experts were computed, copies into an accelerator (timed).

Plain dataclasses filled by ExpertStore under its lock; `as_dict()` is what the API, `generate --stats`
and (later) the server export, `summary()` the one line the CLI prints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property


@dataclass
class TierStats:
    hits: int = 0  # demand lookups this tier answered
    misses: int = 0  # demand lookups it could not answer (served by a slower tier)
    bytes_in: int = 0  # bytes written into this tier (promotions and prefetches)
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


@dataclass
class PrefetchStats:
    predicted: int = 0  # experts named by lookahead hints, over the layer steps that had a hint
    actual: int = 0  # experts those layer steps really used
    correct: int = 0  # named and used
    loaded: int = 0  # experts the background thread loaded (lookahead and in-layer read-ahead)
    used: int = 0  # background loads that a demand then found resident
    late: int = 0  # demands that found their expert still loading and waited for it
    wasted: int = 0  # background loads evicted before any demand used them
    dropped: int = 0  # hinted experts not loaded: no room without evicting a pinned expert, or stale

    # None (JSON null) where undefined: nothing was predicted, or no hinted step used an expert
    @property
    def precision(self) -> float | None:
        return self.correct / self.predicted if self.predicted else None

    @property
    def recall(self) -> float | None:
        return self.correct / self.actual if self.actual else None


@dataclass
class GraphStats:
    """Experts kept by autograd graphs for their backward (ExpertStore.hold)."""

    held: int = 0  # holds taken on an expert the fast tier had (the graph keeps it while the tier does)
    released: int = 0  # holds let go because the store evicted their expert
    refetched: int = 0  # backward passes that fetched a let-go expert again


@dataclass
class HybridStats:
    """Hybrid experts (experts/hybrid.py): layer steps with an expert the fast tier lacked, by where those
    experts were computed."""

    cpu_steps: int = 0  # steps that computed their missing experts on the CPU from host memory
    fetch_steps: int = 0  # steps (auto, many tokens) that fetched them into the fast tier instead
    cpu_experts: int = 0  # experts computed on the CPU from host memory
    filled: int = 0  # experts a CPU step loaded into the fast tier's free room (evicting nothing)


@dataclass
class CopyStats:
    """Experts taken into an accelerator's fast tier (the host -> device copy, and the decode where experts are
    kept decoded), timed on the GPU by CUDA events around each on the stream it ran on: the model's (a demand
    load, which the step waits for) or the prefetcher's side stream (beside the model's compute). An event
    pair is read once it has completed (`harvest`, at the next copy and before a report), never waited for."""

    copies: int = 0
    bytes: int = 0
    side_bytes: int = 0  # of them, copied on the prefetcher's side stream
    timed_bytes: int = 0  # of copies whose events have completed
    copy_s: float = 0.0  # their GPU time

    def __post_init__(self):
        self._pending: list = []  # (start event, end event, bytes): not a field, so not in as_dict

    def record(self, start, end, nbytes: int, side: bool) -> None:
        self.copies += 1
        self.bytes += nbytes
        self.side_bytes += nbytes if side else 0
        self._pending.append((start, end, nbytes))
        self.harvest()

    def harvest(self) -> None:
        left = []
        for start, end, nbytes in self._pending:
            if end.query():
                self.copy_s += start.elapsed_time(end) / 1e3
                self.timed_bytes += nbytes
            else:
                left.append((start, end, nbytes))
        self._pending = left

    @property
    def GBps(self) -> float | None:  # None (JSON null) before any copy was timed
        return self.timed_bytes / self.copy_s / 1e9 if self.copy_s > 0 else None

    @property
    def overlapped(self) -> float | None:  # share of the bytes copied beside the model's compute
        return self.side_bytes / self.bytes if self.bytes else None


@dataclass
class ReadStats:
    """Reads of the checkpoint (experts/reads.py ReadLog): how they went (`mode`: the CheckpointTier's
    --expert-reads as it ended up, direct or buffered), how many by O_DIRECT, and the time at least one was in
    flight (`busy_s`: the union of their intervals), from which the store reports the achieved read rate and the
    share of that time hidden behind compute (`as_dict`)."""

    mode: str = ""
    reads: int = 0
    direct_reads: int = 0
    refused: int = 0  # O_DIRECT asked for and refused by the file system: read buffered
    bytes: int = 0
    busy_s: float = 0.0

    def __post_init__(self):
        self._open: list[tuple[int, int]] = []  # intervals (ns) not yet merged into busy_s: not a field

    def read(self, t0_ns: int, t1_ns: int, nbytes: int, direct: int) -> None:
        self.reads += 1
        self.bytes += nbytes
        self.direct_reads += direct == 1
        self.refused += direct == -1
        self._open.append((t0_ns, t1_ns))
        if len(self._open) >= 512:
            self.merge(final=False)

    def add_busy(self, seconds: float) -> None:
        """Read time of reads on the model's own thread that are not logged one by one (the native decode step's
        in-call loads): nothing else runs meanwhile, so none of it overlaps."""
        self.busy_s += seconds

    def merge(self, final: bool = True) -> None:
        """Merge the open intervals into busy_s; all but the latest merged run unless `final` (a read taken later
        may still overlap it: results are taken roughly in the order reads ran, so this is close)."""
        if not self._open:
            return
        runs: list[list[int]] = []
        for t0, t1 in sorted(self._open):
            if runs and t0 <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], t1)
            else:
                runs.append([t0, t1])
        keep = [] if final else [(runs[-1][0], runs.pop()[1])]
        self.busy_s += sum(t1 - t0 for t0, t1 in runs) / 1e9
        self._open = keep


@dataclass
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)  # fastest first
    disk_reads: int = 0  # experts read from the checkpoint
    disk_bytes: int = 0  # stored bytes read from the checkpoint
    stall_s: float = 0.0  # time fetch waited for experts that were not in the fast tier
    load_s: float = 0.0  # time the model's thread spent reading (demand misses) and taking in experts
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    graph: GraphStats = field(default_factory=GraphStats)
    hybrid: HybridStats = field(default_factory=HybridStats)
    copies: CopyStats = field(default_factory=CopyStats)  # into an accelerator's fast tier (experts/build.py)
    disk_io: ReadStats = field(default_factory=ReadStats)  # the checkpoint's reads (CheckpointTier logs them)
    routed_pairs: int = 0  # (token, expert) pairs of the layer steps that fetched: a read each, token at a time
    fetched: int = 0  # distinct experts those steps fetched

    @property
    def dedup(self) -> float | None:
        """Expert reads token-at-a-time would need over the distinct experts the steps fetched (None: no fetch)."""
        return self.routed_pairs / self.fetched if self.fetched else None

    @property
    def read_GBps(self) -> float | None:
        """Bytes read from the checkpoint over the time reads were in flight."""
        self.disk_io.merge()
        return self.disk_bytes / self.disk_io.busy_s / 1e9 if self.disk_io.busy_s > 0 else None

    @property
    def hidden(self) -> float | None:
        """Share of the read time the model did not wait for: 1 - stalled / in flight."""
        self.disk_io.merge()
        busy = self.disk_io.busy_s
        return max(0.0, 1 - self.stall_s / busy) if busy > 0 else None

    @cached_property  # (the store counts into it on every hit and miss; tiers are fixed once made)
    def fast(self) -> TierStats:
        return next(iter(self.tiers.values()))

    # The single-tier store's names, kept for callers that only care about the fast tier.
    @property
    def hits(self) -> int:
        return self.fast.hits

    @property
    def misses(self) -> int:
        return self.fast.misses

    @property
    def hit_rate(self) -> float:
        return self.fast.hit_rate

    @property
    def bytes_read(self) -> int:
        return self.disk_bytes

    def as_dict(self) -> dict:
        self.disk_io.merge()
        d = asdict(self)
        d.update(hits=self.hits, misses=self.misses, hit_rate=self.hit_rate, bytes_read=self.disk_bytes)
        for name, t in self.tiers.items():
            d["tiers"][name]["hit_rate"] = t.hit_rate
        d["prefetch"].update(precision=self.prefetch.precision, recall=self.prefetch.recall)
        self.copies.harvest()
        d["copies"] = dict(asdict(self.copies), GBps=self.copies.GBps, overlapped=self.copies.overlapped)
        d["disk_io"] = dict(asdict(self.disk_io), read_GBps=self.read_GBps, hidden=self.hidden)
        d["dedup"] = self.dedup
        return d

    def summary(self) -> str:
        tiers = ", ".join(f"{n} {t.hits} hits / {t.misses} misses ({t.hit_rate:.0%})" for n, t in self.tiers.items())
        line = (f"experts: {tiers}; disk {self.disk_reads} reads, {self.disk_bytes / 1e6:.1f} MB; "
                f"stalled {self.stall_s * 1e3:.0f} ms")
        p = self.prefetch
        if p.loaded or p.predicted:
            line += (f"; prefetch precision {_percent(p.precision)} recall {_percent(p.recall)}, {p.loaded} loaded, "
                     f"{p.used} used, {p.late} late, {p.wasted} wasted, {p.dropped} dropped")
        if self.disk_bytes:
            gbps = self.read_GBps
            line += (f"; reads {self.disk_io.mode or 'buffered'} at "
                     + ("n/a" if gbps is None else f"{gbps:.2f} GB/s") + f" in flight, {_percent(self.hidden)} hidden")
        if self.fetched:
            line += f"; dedup {self.dedup:.2f}x"
        h = self.hybrid
        if h.cpu_steps or h.fetch_steps:
            line += (f"; hybrid: {h.cpu_steps} layer steps computed {h.cpu_experts} experts on the CPU, "
                     f"{h.fetch_steps} fetched them")
        c = self.copies
        c.harvest()
        if c.copies:
            rate = "n/a" if c.GBps is None else f"{c.GBps:.1f} GB/s"
            line += f"; copied up {c.bytes / 1e6:.1f} MB at {rate}, {_percent(c.overlapped)} beside compute"
        return line


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"
