"""`GET /metrics`: the server's counters in the Prometheus text exposition format (0.0.4), by `prometheus_client`.

Each app gets its own CollectorRegistry, not the library's global one, so
several apps in one process (tests, an embedding program) never collide on a
metric name. The `_created` series prometheus_client adds to every counter and
histogram are left out of the text (they were never part of kvblend's
metrics), by this registry alone: the library's process-wide switch would
change them for a program that embeds kvblend too. prometheus_client's
metrics are thread-safe, so no lock of ours is needed.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, Metric

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SHARE_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes
SOURCES = ("hit", "computed")


class Metrics:
    """Requests by status, TTFT and recompute share histograms, segment hits/misses, queue depth."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvblend_requests", "Chat completion requests by HTTP status.", ["status"], registry=r)
        self.ttft = Histogram(
            "kvblend_ttft_seconds", "Time to first token (fusion + first token).", buckets=TTFT_BUCKETS, registry=r
        )
        self.share = Histogram(
            "kvblend_recompute_share",
            "Compute per request as a share of a full prefill (stored misses included).",
            buckets=SHARE_BUCKETS,
            registry=r,
        )
        self.segments = Counter(
            "kvblend_segments",
            "Passages by source: hit (archived KV reused) or computed (a miss).",
            ["source"],
            registry=r,
        )
        for source in SOURCES:  # both series exist from the start, at 0
            self.segments.labels(source=source)
        self.queue_depth = Gauge("kvblend_queue_depth", "Requests waiting for the model.", registry=r)
        self.busy = Gauge("kvblend_busy", "1 while the model works on a request.", registry=r)
        self.running = Gauge(
            "kvblend_running_sequences", "Sequences admitted to the batch (prefilling or decoding).", registry=r
        )
        self._outcomes = _SchedulerOutcomes()
        r.register(self._outcomes)

    def request(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def answered(self, ttft_s: float, share: float, sources: list[str]) -> None:
        """One answered request: its TTFT, recompute share, and each segment's source."""
        self.ttft.observe(ttft_s)
        self.share.observe(share)
        for source in sources:
            self.segments.labels(source=source).inc()

    def render(self, queue_depth: int, busy: bool, running: int = 0, outcomes: dict[str, int] | None = None) -> str:
        """The exposition text; queue depth, busy, running sequences and the scheduler's request outcomes
        (submitted, and finished by status) are sampled by the caller now."""
        self.queue_depth.set(queue_depth)
        self.busy.set(int(busy))
        self.running.set(running)
        self._outcomes.sampled = outcomes
        return generate_latest(_WithoutCreated(self.registry)).decode()


class _WithoutCreated:
    """A registry's metrics without their `_created` samples (what generate_latest reads: collect())."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class _SchedulerOutcomes:
    """The scheduler's own request counts, which it keeps and /metrics samples (submitted = finished by status
    (stop + length + abort + error) + waiting + running): counters the scheduler owns, so a custom collector."""

    def __init__(self) -> None:
        self.sampled: dict[str, int] | None = None

    def collect(self) -> Iterator[Metric]:
        outcomes = self.sampled
        if outcomes is None:
            return
        submitted = CounterMetricFamily("kvblend_scheduler_submitted", "Requests the scheduler queued.")
        submitted.add_metric([], outcomes.get("submitted", 0))
        yield submitted
        finished = CounterMetricFamily(
            "kvblend_scheduler_finished",
            "Requests the scheduler finished, by status: stop, length, abort (client left or shutdown), error.",
            labels=["status"],
        )
        for status, n in outcomes.items():
            if status != "submitted":
                finished.add_metric([status], n)
        yield finished
