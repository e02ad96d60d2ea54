"""`GET /metrics`: the server's counters in the Prometheus text exposition format (0.0.4).

Written by hand: five metric families do not justify a dependency, and the
format is a few lines of text. Updated from the event loop and read from it,
but guarded by a lock anyway, so a future caller on another thread is safe.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SHARE_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5)


@dataclass
class Histogram:
    """Cumulative buckets, sum and count, as Prometheus histograms expose them."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {_num(self.total)}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    """Requests by status, TTFT and recompute share histograms, segment hits/misses, queue depth."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[int] = Counter()
        self.segments: Counter[str] = Counter({"hit": 0, "computed": 0})
        self.ttft = Histogram(TTFT_BUCKETS)
        self.share = Histogram(SHARE_BUCKETS)

    def request(self, status: int) -> None:
        with self._lock:
            self.requests[status] += 1

    def answered(self, ttft_s: float, share: float, sources: list[str]) -> None:
        """One answered request: its TTFT, recompute share, and each segment's source."""
        with self._lock:
            self.ttft.observe(ttft_s)
            self.share.observe(share)
            self.segments.update(sources)

    def render(self, queue_depth: int, busy: bool, running: int = 0, outcomes: dict[str, int] | None = None) -> str:
        """The exposition text; queue depth, busy, running sequences and the scheduler's request outcomes
        (submitted, and finished by status) are sampled by the caller now."""
        with self._lock:
            lines = _family("kvblend_requests_total", "counter", "Chat completion requests by HTTP status.")
            lines += [f'kvblend_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += _family("kvblend_ttft_seconds", "histogram", "Time to first token (fusion + first token).")
            lines += self.ttft.lines("kvblend_ttft_seconds")
            lines += _family(
                "kvblend_recompute_share",
                "histogram",
                "Compute per request as a share of a full prefill (stored misses included).",
            )
            lines += self.share.lines("kvblend_recompute_share")
            lines += _family(
                "kvblend_segments_total",
                "counter",
                "Passages by source: hit (archived KV reused) or computed (a miss).",
            )
            lines += [f'kvblend_segments_total{{source="{s}"}} {n}' for s, n in sorted(self.segments.items())]
        lines += _family("kvblend_queue_depth", "gauge", "Requests waiting for the model.")
        lines.append(f"kvblend_queue_depth {queue_depth}")
        lines += _family("kvblend_busy", "gauge", "1 while the model works on a request.")
        lines.append(f"kvblend_busy {int(busy)}")
        lines += _family(
            "kvblend_running_sequences", "gauge", "Sequences admitted to the batch (prefilling or decoding)."
        )
        lines.append(f"kvblend_running_sequences {running}")
        if outcomes is not None:  # submitted = finished (stop + length + abort + error) + waiting + running
            lines += _family("kvblend_scheduler_submitted_total", "counter", "Requests the scheduler queued.")
            lines.append(f"kvblend_scheduler_submitted_total {outcomes.get('submitted', 0)}")
            lines += _family(
                "kvblend_scheduler_finished_total",
                "counter",
                "Requests the scheduler finished, by status: stop, length, abort (client left or shutdown), error.",
            )
            lines += [
                f'kvblend_scheduler_finished_total{{status="{s}"}} {n}' for s, n in outcomes.items() if s != "submitted"
            ]
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _num(value: float) -> str:
    """A sample value as Prometheus parses it (Go's ParseFloat reads Python's float repr)."""
    return repr(float(value))
