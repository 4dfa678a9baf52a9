"""Prometheus metrics, one registry per app (no process globals).

Counters and histograms are updated on the request path; per-backend gauges (in flight,
breaker state, health) and the queue depth are read from live objects at scrape time.

The three series every request updates (``pdproxy_requests``, ``pdproxy_leg_latency_seconds``,
``pdproxy_time_to_first_byte_seconds``) are :class:`LoopCounter` and :class:`LoopHistogram`:
plain numbers per label set, no lock and no checks per update (prometheus_client's take a lock
and run a Python loop over the buckets: ~30 Python calls per request). They are updated and
collected on the event loop only, which is the one thread that ever touches them; their
exposition is prometheus_client's own, sample for sample (``tests/pdproxy/observe``).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, cast

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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


class _Count:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()


class LoopCounter(Collector):
    """A labelled counter for the event loop's thread only: :meth:`child` once per label
    set, then ``child.value += 1``; exposed as prometheus_client's ``Counter`` is."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Count] = {}

    def child(self, *labels: str) -> _Count:
        found = self._children.get(labels)
        if found is None:
            found = self._children[labels] = _Count()
        return found

    def forget(self, label: str, value: str) -> None:
        """Drop every series whose ``label`` is ``value`` (a model no backend serves any more)."""
        at = self._labelnames.index(label)
        for labels in [k for k in self._children if k[at] == value]:
            del self._children[labels]

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self._name, self._doc, "counter")
        for labels, count in list(self._children.items()):
            named = dict(zip(self._labelnames, labels, strict=True))
            metric.add_sample(self._name + "_total", named, count.value)
            metric.add_sample(self._name + "_created", named, count.created)
        yield metric


class _Buckets:
    __slots__ = ("counts", "created", "sum")

    def __init__(self, size: int) -> None:
        self.counts = [0] * size
        self.sum = 0.0
        self.created = time.time()


class LoopHistogram(Collector):
    """A labelled histogram for the event loop's thread only: :meth:`observe` finds the
    bucket by bisection (in C) and adds; exposed as prometheus_client's ``Histogram`` is."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]
    ) -> None:
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        bounds = [float(b) for b in buckets]
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._bounds = bounds
        go_string = cast(Callable[[float], str], floatToGoString)  # untyped upstream
        self._les = [go_string(b) for b in bounds]
        self._children: dict[tuple[str, ...], _Buckets] = {}

    def observe(self, labels: tuple[str, ...], amount: float) -> None:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = _Buckets(len(self._bounds))
        # The first bucket whose bound is >= amount (prometheus_client's ``amount <= bound``).
        child.counts[bisect_left(self._bounds, amount)] += 1
        child.sum += amount

    def collect(self) -> Iterator[Metric]:
        metric = Metric(self._name, self._doc, "histogram")
        name = self._name
        for labels, child in list(self._children.items()):
            named = dict(zip(self._labelnames, labels, strict=True))
            total = 0.0
            for le, count in zip(self._les, child.counts, strict=True):
                total += count
                metric.add_sample(name + "_bucket", {**named, "le": le}, total)
            metric.add_sample(name + "_count", named, total)
            metric.add_sample(name + "_sum", named, child.sum)
            metric.add_sample(name + "_created", named, child.created)
        yield metric


class ProxyMetrics:
    def __init__(self, backends: BackendSource, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = LoopCounter(
            "pdproxy_requests",
            "Client requests by route, status and dialect",
            ["route", "status", "dialect"],
        )
        r.register(self.requests)
        self.leg_latency = LoopHistogram(
            "pdproxy_leg_latency_seconds",
            "Upstream leg latency (producer: whole answer; consumer: whole leg)",
            ["leg", "backend"],
            buckets=_LATENCY_BUCKETS,
        )
        r.register(self.leg_latency)
        self.ttfb = LoopHistogram(
            "pdproxy_time_to_first_byte_seconds",
            "Client request start to the first byte committed to the client",
            ["route"],
            buckets=_LATENCY_BUCKETS,
        )
        r.register(self.ttfb)
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

    # Labelled children of prometheus_client's metrics are cached (``labels()`` takes a lock
    # each call); the per-request series are the loop's own (module docstring).

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        key = (id(metric), *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count_request(self, route: str, status: int, dialect: str) -> None:
        self.requests.child(route, status_label(status), dialect).value += 1

    def observe_leg(self, leg: str, backend: str, seconds: float) -> None:
        self.leg_latency.observe((leg, backend), seconds)

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self.ttfb.observe((route,), seconds)

    def upstream_failure(self, backend: str, kind: str) -> None:
        self._child(self.upstream_failures, backend, kind).inc()


_STATUS = {code: str(code) for code in range(100, 600)}
"""Each status's label, made once (``str(status)`` on every request otherwise)."""


def status_label(status: int) -> str:
    return _STATUS.get(status) or str(status)
