"""Prometheus metrics of the router's outside signals: index exactness per node (a gauge read
at scrape time), engine-load readings and scrape outcomes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdproxy.routing.kv.node_signals import NodeSignals


class _SignalsCollector(Collector):
    def __init__(self, signals: NodeSignals, clock: Callable[[], float]) -> None:
        self._signals = signals
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        exactness = GaugeMetricFamily(
            "pdproxy_kv_index_exactness",
            "Trust in a node's KV residency: 0 exact, 1 degraded (an event gap being "
            "replayed), 2 stale (events lost for good, or silent while work was sent)",
            labels=["node"],
        )
        age = GaugeMetricFamily(
            "pdproxy_kv_index_event_age_seconds",
            "Seconds since a node's last KV event batch was delivered",
            labels=["node"],
        )
        ex = self._signals.exactness
        for node in ex.nodes():
            state = ex.of(node, now)
            exactness.add_metric([node], int(state.state))
            if state.event_age_s is not None:
                age.add_metric([node], state.event_age_s)
        yield exactness
        yield age
        readings = self._signals.readings
        reading_age = GaugeMetricFamily(
            "pdproxy_kv_engine_reading_age_seconds",
            "Age of a node's last engine-load reading (ignored past the staleness bound)",
            labels=["node"],
        )
        waiting = GaugeMetricFamily(
            "pdproxy_kv_engine_waiting_requests",
            "Requests the engine reported waiting in its last reading",
            labels=["node"],
        )
        for node in readings.nodes():
            reading = readings.latest(node)
            if reading is not None:
                reading_age.add_metric([node], reading.age_s(now))
                waiting.add_metric([node], reading.sample.waiting)
        yield reading_age
        yield waiting


class SignalMetrics:
    def __init__(
        self,
        signals: NodeSignals,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scrapes = Counter(
            "pdproxy_kv_engine_scrapes",
            "Engine /metrics scrapes by node and result (ok, timeout, too_large, status, "
            "transport, no_load, error)",
            ["node", "result"],
            registry=registry,
        )
        registry.register(_SignalsCollector(signals, clock))

    def scraped(self, node: str, result: str) -> None:
        self.scrapes.labels(node, result).inc()
