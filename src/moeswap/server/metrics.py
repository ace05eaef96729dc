"""The server's Prometheus metrics (prometheus-client), in a registry of its own per app.

Requests by endpoint and HTTP status and by finish reason; time to first token, time per output token and
end-to-end latency histograms (from the request's arrival, as its client sees them); running and waiting
requests; prompt and generated tokens; and the expert store's counters, read from its StoreStats at each
scrape: hits and misses per tier, bytes read per tier (disk: from the checkpoint), prefetch accuracy.
Entry point: `ServerMetrics(engine_loop, store)`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets from a fast tiny model (sub-ms per token) up to a swapping giant one (seconds per token)
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("moeswap_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.requests_finished = Counter("moeswap_requests_finished", "Generation requests by the finish reason "
                                         "their client got (stop, length, error; abort: the client left)",
                                         ["finish_reason"], registry=r)
        self.ttft = Histogram("moeswap_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("moeswap_time_per_output_token_seconds", "First to last token over the tokens after "
                              "the first", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("moeswap_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY,
                             registry=r)
        self.prompt_tokens = Counter("moeswap_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("moeswap_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("moeswap_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("moeswap_requests_waiting", "Requests accepted and waiting for a slot", registry=r)

    def attach(self, engine_loop, store=None) -> None:
        """Gauges read from the engine loop, and the expert store's counters, at each scrape."""
        self.running.set_function(lambda: engine_loop.running)
        self.waiting.set_function(lambda: engine_loop.waiting)
        if store is not None:
            self.registry.register(_StoreCollector(store))

    def latency(self, ttft: float | None, tpot: float | None, e2e: float) -> None:
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.e2e.observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector:
    """The expert store's StoreStats as Prometheus metrics (the store owns the counts; nothing is copied)."""

    def __init__(self, store) -> None:
        self.store = store

    def collect(self):
        st = self.store.stats
        hits = CounterMetricFamily("moeswap_expert_hits", "Expert lookups a tier answered", labels=["tier"])
        misses = CounterMetricFamily("moeswap_expert_misses", "Expert lookups a tier could not answer",
                                     labels=["tier"])
        read = CounterMetricFamily("moeswap_expert_bytes_read", "Bytes of experts read into a tier; disk: "
                                   "stored bytes read from the checkpoint", labels=["tier"])
        for name, t in list(st.tiers.items()):
            hits.add_metric([name], t.hits)
            misses.add_metric([name], t.misses)
            read.add_metric([name], t.bytes_in)
        read.add_metric(["disk"], st.disk_bytes)
        yield from (hits, misses, read)
        p = st.prefetch
        pf = CounterMetricFamily("moeswap_expert_prefetch", "Prefetch: experts predicted by lookahead, actually "
                                 "used by those steps, predicted and used (correct), loaded in the background, "
                                 "wasted", labels=["kind"])
        for kind in ("predicted", "actual", "correct", "loaded", "used", "late", "wasted", "dropped"):
            pf.add_metric([kind], getattr(p, kind))
        yield pf
        acc = GaugeMetricFamily("moeswap_expert_prefetch_accuracy", "Prefetch precision (correct / predicted) and "
                                "recall (correct / actual) so far; absent until defined", labels=["measure"])
        for measure in ("precision", "recall"):
            value = getattr(p, measure)
            if value is not None:
                acc.add_metric([measure], value)
        yield acc
