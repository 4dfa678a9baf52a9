"""Engine-reported load: what each backend's ``/metrics`` says it holds beyond this proxy's own
requests (another client, another proxy without shared state), charged on top of the load term.

The scraper (:mod:`pdproxy.routing.kv.engine_scrape`, the I/O) writes the latest reading of each
node into :class:`EngineLoadReadings`; each decision's view holds the term of every candidate.
With a fresh reading (engine: ``W`` waiting, ``R`` running, KV usage ``u``; this proxy had
``I0`` requests in flight on the node when it was scraped)::

    external = max(W + R - I0, 0)                   requests the engine holds for others
    term     = in_flight_tokens       * external
             + waiting_request_tokens * W           the engine cannot even start them
             + kv_usage_tokens * max(u - knee, 0) / (1 - knee)

The router's own in-flight charge (``in_flight_tokens * I``, with ``I`` the current count) is
the load scorer's (:mod:`~pdproxy.routing.kv.scorers.load`), so a request this proxy sent is
charged once as a request, never twice. Subtracting ``I0`` (the count at scrape time, not the
current one) keeps the two figures from the same moment. Requests of ours that the engine does
not hold yet (a consumer leg waiting for its producer) make ``external`` too small, never too
large: the error is toward the old behaviour. The waiting term is charged for every waiting
request, ours included: the proxy's count cannot tell a running request from a queued one, the
engine's can.

No reading, one older than ``stale_intervals`` scrape intervals, or ``enabled: false``: the term
is 0 (own in-flight count only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdproxy.routing.kv.engine_metrics_text import EngineSample
from pdproxy.routing.kv.plan import NodeState, PromptShape, Task, Term
from pdproxy.routing.kv.pull_link import PullCounters, PullMeasurement
from pdproxy.routing.kv.scorers.base import Ask, Scorer, View, rows
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import CostWeights, EngineLoadSettings


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One scrape of one node, with this proxy's own requests on the node at that moment
    (so that the cost charges only the requests the engine holds for others)."""

    sample: EngineSample
    own_in_flight: int
    at: float
    """Monotonic time the scrape finished."""

    def age_s(self, now: float) -> float:
        return max(now - self.at, 0.0)


class EngineLoadReadings:
    """The latest reading per node (state; the scraper writes it). A reading older than
    ``max_age_s`` is not fresh: the node is then charged by the router's own count alone."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._latest: dict[str, EngineReading] = {}
        self.pull_counters = PullCounters()
        self.on_pull: Callable[[str, PullMeasurement], None] | None = None
        """Told of each node's pulls measured between two readings (the pull scorer's link
        speed: the workers' pull counters come with the same scrape)."""
        self.on_reading: Callable[[str, EngineReading], None] | None = None
        """Told of each reading as it is stored (the TTFT model's engine-reported queue)."""

    def put(self, node: str, reading: EngineReading) -> None:
        self._latest[node] = reading
        if self.on_reading is not None:
            self.on_reading(node, reading)
        measured = self.pull_counters.update(node, reading.sample)
        if measured is not None and self.on_pull is not None:
            self.on_pull(node, measured)

    def drop(self, node: str) -> None:
        self._latest.pop(node, None)
        self.pull_counters.forget(node)

    def latest(self, node: str) -> EngineReading | None:
        """The last reading, however old (for the explain header and metrics)."""
        return self._latest.get(node)

    def fresh(self, node: str, now: float) -> EngineReading | None:
        reading = self._latest.get(node)
        if reading is None or reading.age_s(now) > self.max_age_s:
            return None
        return reading

    def nodes(self) -> list[str]:
        return sorted(self._latest)


def external_requests(reading: EngineReading) -> int:
    """Requests the engine reported that this proxy had not sent (at scrape time)."""
    s = reading.sample
    return max(s.waiting + s.running - reading.own_in_flight, 0)


def engine_load_tokens(
    reading: EngineReading | None, weights: CostWeights, settings: EngineLoadSettings
) -> float:
    """The term added to a node's load (0.0 without a fresh reading)."""
    if reading is None:
        return 0.0
    s = reading.sample
    term = weights.in_flight_tokens * external_requests(reading)
    term += settings.waiting_request_tokens * s.waiting
    if s.kv_usage is not None and s.kv_usage > settings.kv_usage_knee:
        over = (s.kv_usage - settings.kv_usage_knee) / (1.0 - settings.kv_usage_knee)
        term += settings.kv_usage_tokens * min(over, 1.0)
    return term


@dataclass(frozen=True, slots=True)
class EngineLoadView(View):
    terms: Mapping[str, float]
    """Each candidate's term (absent: 0)."""

    def cost(self, node: NodeState, task: Task, prompt: PromptShape) -> Term:
        return Term(self.terms.get(node.name, 0.0), load=True)


class _ReadingsCollector(Collector):
    def __init__(self, readings: EngineLoadReadings, clock: Callable[[], float]) -> None:
        self._readings = readings
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        age = GaugeMetricFamily(
            "pdproxy_kv_engine_reading_age_seconds",
            "Age of a node's last engine-load reading (ignored past the staleness bound)",
            labels=["node"],
        )
        waiting = GaugeMetricFamily(
            "pdproxy_kv_engine_waiting_requests",
            "Requests the engine reported waiting in its last reading",
            labels=["node"],
        )
        for node in self._readings.nodes():
            reading = self._readings.latest(node)
            if reading is not None:
                age.add_metric([node], reading.age_s(now))
                waiting.add_metric([node], reading.sample.waiting)
        yield age
        yield waiting


class EngineLoadScorer(Scorer[EngineLoadView]):
    name = "engine_load"

    def __init__(
        self, settings: EngineLoadSettings, weights: CostWeights, registry: CollectorRegistry
    ) -> None:
        self.settings = settings
        self._weights = weights
        self.readings = EngineLoadReadings(settings.interval_s * settings.stale_intervals)
        self._none = EngineLoadView({})
        self.scrapes = Counter(
            "pdproxy_kv_engine_scrapes",
            "Engine /metrics scrapes by node and result (ok, timeout, too_large, status, "
            "transport, no_load, error)",
            ["node", "result"],
            registry=registry,
        )

    def scraped(self, node: str, result: str) -> None:
        """The scraper's outcome for one node (``ok`` or a failure kind)."""
        self.scrapes.labels(node, result).inc()

    def observe(self, ask: Ask) -> EngineLoadView:
        if not self.settings.enabled:
            return self._none
        names = sorted({b.name for b in ask.candidates})
        return EngineLoadView(
            {
                n: engine_load_tokens(self.readings.fresh(n, ask.now), self._weights, self.settings)
                for n in names
            }
        )

    def annotate(self, explain: Mapping[str, Any], now: float) -> None:
        """Each row gains the engine's last reading (stale ones too: ``fresh`` says which)."""
        if not self.settings.enabled:
            return
        for row in rows(explain):
            name = str(row.get("name"))
            reading = self.readings.latest(name)
            if reading is None:
                continue
            row["engine"] = {
                "waiting": reading.sample.waiting,
                "running": reading.sample.running,
                "external": external_requests(reading),
                "age_s": round(reading.age_s(now), 2),
                "fresh": self.readings.fresh(name, now) is not None,
            }


def build(
    settings: KvRouterSettings,
    registry: CollectorRegistry,
    clock: Callable[[], float] = time.monotonic,
) -> EngineLoadScorer:
    scorer = EngineLoadScorer(settings.engine_load, settings.weights, registry)
    registry.register(_ReadingsCollector(scorer.readings, clock))
    return scorer
