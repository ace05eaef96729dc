"""Counters of the expert store: hits and misses per tier, bytes moved, time stalled, prefetch accuracy,
experts kept for backward passes, where hybrid experts were computed.

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
class StoreStats:
    tiers: dict[str, TierStats] = field(default_factory=dict)  # fastest first
    disk_reads: int = 0  # experts read from the checkpoint
    disk_bytes: int = 0  # stored bytes read from the checkpoint
    stall_s: float = 0.0  # time fetch waited for experts that were not in the fast tier
    load_s: float = 0.0  # time the model's thread spent reading (demand misses) and taking in experts
    prefetch: PrefetchStats = field(default_factory=PrefetchStats)
    graph: GraphStats = field(default_factory=GraphStats)
    hybrid: HybridStats = field(default_factory=HybridStats)

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
        d = asdict(self)
        d.update(hits=self.hits, misses=self.misses, hit_rate=self.hit_rate, bytes_read=self.disk_bytes)
        for name, t in self.tiers.items():
            d["tiers"][name]["hit_rate"] = t.hit_rate
        d["prefetch"].update(precision=self.prefetch.precision, recall=self.prefetch.recall)
        return d

    def summary(self) -> str:
        tiers = ", ".join(f"{n} {t.hits} hits / {t.misses} misses ({t.hit_rate:.0%})" for n, t in self.tiers.items())
        line = (f"experts: {tiers}; disk {self.disk_reads} reads, {self.disk_bytes / 1e6:.1f} MB; "
                f"stalled {self.stall_s * 1e3:.0f} ms")
        p = self.prefetch
        if p.loaded or p.predicted:
            line += (f"; prefetch precision {_percent(p.precision)} recall {_percent(p.recall)}, {p.loaded} loaded, "
                     f"{p.used} used, {p.late} late, {p.wasted} wasted, {p.dropped} dropped")
        h = self.hybrid
        if h.cpu_steps or h.fetch_steps:
            line += (f"; hybrid: {h.cpu_steps} layer steps computed {h.cpu_experts} experts on the CPU, "
                     f"{h.fetch_steps} fetched them")
        return line


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"
