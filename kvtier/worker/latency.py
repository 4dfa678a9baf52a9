"""Per-token latency histograms of the engine (TTFT, ITL, TPOT), as vLLM's engine exports them.

Plain counters updated by the engine loop; the server's collector turns them into Prometheus
histograms at scrape time (no prometheus_client on the engine's path).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Upper bounds in seconds (``+Inf`` is implied)."""


@dataclass(slots=True)
class LatencyHistogram:
    """Cumulative-on-read histogram over :data:`LATENCY_BUCKETS`."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs ending with ``+Inf``, as Prometheus exposes them."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass(slots=True)
class TokenLatencies:
    """Time to first token (arrival to first sampled token), inter-token latency (between
    consecutive tokens of one request) and time per output token (a finished request's decode
    time over its tokens after the first)."""

    time_to_first_token: LatencyHistogram = field(default_factory=LatencyHistogram)
    inter_token: LatencyHistogram = field(default_factory=LatencyHistogram)
    time_per_output_token: LatencyHistogram = field(default_factory=LatencyHistogram)
