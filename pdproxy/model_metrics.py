"""Per-model metrics. The ``model`` label takes only names the model catalog knows (configured,
or learned from backends up to ``models.max_learned``) and ``other``: never a string a client
chose, so the number of series stays bounded."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdproxy.admission import ModelAdmission


class _ModelLoad(Collector):
    def __init__(self, admission: ModelAdmission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "pdproxy_model_in_flight", "Requests in flight per model", labels=["model"]
        )
        queued = GaugeMetricFamily(
            "pdproxy_model_queue_depth",
            "Requests waiting for their model's admission",
            labels=["model"],
        )
        for label, active, waiting in self._admission.snapshot():
            in_flight.add_metric([label], active)
            queued.add_metric([label], waiting)
        yield from (in_flight, queued)


class ModelMetrics:
    def __init__(self, registry: CollectorRegistry, admission: ModelAdmission) -> None:
        self.requests = Counter(
            "pdproxy_model_requests",
            "Client requests by model and status (models the proxy knows, else 'other')",
            ["model", "status"],
            registry=registry,
        )
        self.refused = Counter(
            "pdproxy_model_admission_refused",
            "Requests refused by their model's admission (queue full or wait timed out)",
            ["model"],
            registry=registry,
        )
        registry.register(_ModelLoad(admission))
        admission.on_release = self.count
        admission.on_refused = lambda label: self.refused.labels(label).inc()

    def count(self, label: str, status: int) -> None:
        self.requests.labels(label, str(status)).inc()
