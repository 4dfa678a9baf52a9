"""``/metrics`` of a worker with several data-parallel ranks: every rank's families merged,
each sample labelled ``data_parallel_rank`` (one family per name, as Prometheus requires)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvtier.worker.server.metrics import WorkerCollector
from kvtier.worker.worker import Worker

RANK_LABEL = "data_parallel_rank"


class RanksCollector(Collector):
    def __init__(self, workers: Sequence[Worker]) -> None:
        self._ranks = [(str(r), WorkerCollector(w)) for r, w in enumerate(workers)]

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for rank, collector in self._ranks:
            for family in collector.collect():
                out = merged.get(family.name)
                if out is None:
                    out = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = out
                out.samples.extend(
                    Sample(s.name, {**s.labels, RANK_LABEL: rank}, s.value, s.timestamp,
                           s.exemplar)
                    for s in family.samples
                )  # fmt: skip
        yield from merged.values()


def ranks_registry(workers: Sequence[Worker]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RanksCollector(workers))
    return registry
