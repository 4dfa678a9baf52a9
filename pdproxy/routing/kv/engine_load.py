"""Engine-reported load per node: the latest reading of each backend's ``/metrics`` (state only;
the scraper in :mod:`pdproxy.routing.kv.engine_scrape` writes it, the cost term in
:mod:`pdproxy.routing.kv.engine_load_cost` reads it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdproxy.routing.kv.engine_metrics_text import EngineSample
from pdproxy.routing.kv.pull_link import PullCounters, PullMeasurement


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
    """The latest reading per node. A reading older than ``max_age_s`` is not returned: the
    node is then charged by the router's own in-flight count alone."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._latest: dict[str, EngineReading] = {}
        self.pull_counters = PullCounters()
        self.on_pull: Callable[[str, PullMeasurement], None] | None = None
        """Told of each node's pulls measured between two readings (the router's link speed)."""

    def put(self, node: str, reading: EngineReading) -> None:
        self._latest[node] = reading
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
