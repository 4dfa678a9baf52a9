"""Prometheus metrics, one registry per app (no process globals).

Counters and histograms are updated on the request path; per-backend gauges (in flight,
breaker state, health) and the queue depth are read from live objects at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)  # fmt: skip


class _BreakerView(Protocol):
    @property
    def state(self) -> int: ...


class LiveBackend(Protocol):
    """What the live gauges read of a backend (:class:`pdproxy.fleet.backends.Backend`)."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def breaker(self) -> _BreakerView: ...


class BackendSource(Protocol):
    def all(self) -> Iterable[LiveBackend]: ...


class _LiveCollector(Collector):
    def __init__(self, backends: BackendSource, queue_depth: Callable[[], int]) -> None:
        self._backends = backends
        self._queue_depth = queue_depth

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "pdproxy_backend_in_flight", "Requests in flight per backend", labels=["backend"]
        )
        breaker = GaugeMetricFamily(
            "pdproxy_backend_breaker_state",
            "Breaker state per backend (0 closed, 1 half-open, 2 open)",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "pdproxy_backend_healthy", "Active health check verdict per backend", labels=["backend"]
        )
        for b in self._backends.all():
            in_flight.add_metric([b.name], b.in_flight)
            breaker.add_metric([b.name], int(b.breaker.state))
            healthy.add_metric([b.name], 1.0 if b.healthy else 0.0)
        queue = GaugeMetricFamily("pdproxy_queue_depth", "Requests waiting for admission")
        queue.add_metric([], self._queue_depth())
        yield from (in_flight, breaker, healthy, queue)


class ProxyMetrics:
    def __init__(self, backends: BackendSource, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdproxy_requests",
            "Client requests by route, status and dialect",
            ["route", "status", "dialect"],
            registry=r,
        )
        self.leg_latency = Histogram(
            "pdproxy_leg_latency_seconds",
            "Upstream leg latency (producer: whole answer; consumer: whole leg)",
            ["leg", "backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "pdproxy_time_to_first_byte_seconds",
            "Client request start to the first byte committed to the client",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter("pdproxy_retries", "Leg retries", ["leg"], registry=r)
        self.fallbacks = Counter(
            "pdproxy_fallbacks",
            "Requests served by the consumer alone, without the producer's KV: every producer "
            "failed, or every consumer leg carrying the KV failed with a server error",
            registry=r,
        )
        self.disconnect_aborts = Counter(
            "pdproxy_disconnect_aborts",
            "Client disconnects that cancelled in-flight legs",
            ["stage"],
            registry=r,
        )
        self.releases = Counter(
            "pdproxy_kv_releases", "P2P supply releases sent to producers", ["result"], registry=r
        )
        self.upstream_failures = Counter(
            "pdproxy_upstream_failures",
            "Failed upstream legs by backend and kind (transport, timeout, status_5xx, "
            "status_429, kv_address, consumer_stream_broken, consumer_idle): the details "
            "clients are not told",
            ["backend", "kind"],
            registry=r,
        )
        self.breaker_confirmations = Counter(
            "pdproxy_breaker_confirmations",
            "Health checks run to confirm a failure no other backend disproved, by result",
            ["backend", "result"],
            registry=r,
        )
        self.kv_address_mismatches = Counter(
            "pdproxy_kv_address_mismatches",
            "Producer answers refused for naming a remote_host/remote_port other than the "
            "backend's kv_address",
            ["backend"],
            registry=r,
        )
        self.body_read_timeouts = Counter(
            "pdproxy_body_read_timeouts",
            "Requests whose body did not arrive within body_read_timeout_s",
            registry=r,
        )
        r.register(_LiveCollector(backends, queue_depth))
        self._children: dict[tuple[object, ...], Any] = {}

    # Hot-path helpers: labelled children are cached (``labels()`` takes a lock each call).

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count_request(self, route: str, status: int, dialect: str) -> None:
        self._child(self.requests, route, str(status), dialect).inc()

    def observe_leg(self, leg: str, backend: str, seconds: float) -> None:
        self._child(self.leg_latency, leg, backend).observe(seconds)

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self._child(self.ttfb, route).observe(seconds)

    def upstream_failure(self, backend: str, kind: str) -> None:
        self._child(self.upstream_failures, backend, kind).inc()
