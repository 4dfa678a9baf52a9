"""The connector's telemetry as vLLM carries it: worker → scheduler → API server → ``/metrics``.

The worker side returns a :class:`KvtierConnectorStats` from ``get_kv_connector_stats`` after a
step in which something changed: counters as deltas since the previous report, gauges as their
current value. vLLM ships it to the API server process, where :class:`KvtierPromMetrics`
(built by ``KvtierConnector.build_prom_metrics``) adds the deltas to counters and sets the gauges.
Gauges are therefore as fresh as the engine's last step: a supply released between steps (a
consumer's ``done``) shows after the next step.

Exposed on vLLM's ``/metrics`` (each with vLLM's ``engine``/``model_name`` labels):

- ``vllm:kvtier_blocks_supplied_total``: blocks a producer leg offered under its kv_request_id;
  ``vllm:kvtier_blocks_stored_total``: of those, blocks copied from vLLM's KV cache (the rest
  were already in the host tier: no copy);
- ``vllm:kvtier_fetch_bytes_total``, ``vllm:kvtier_fetch_seconds_total``,
  ``vllm:kvtier_blocks_fetched_total``: what consumer fetches moved, and how long they took;
- ``vllm:kvtier_blocks_loaded_total``: blocks installed into vLLM's KV cache;
  ``vllm:kvtier_blocks_recomputed_total``: blocks of a planned load that vLLM recomputes (a
  short or failed fetch); ``vllm:kvtier_fetch_failures_total``: fetches that fell short;
- ``vllm:kvtier_blocks_offloaded_total``, ``vllm:kvtier_offload_seconds_total``: prompt blocks
  copied into host pages under ``offload_prompts``, and the engine thread's time doing it;
- ``vllm:kvtier_offers_answered_total``, ``vllm:kvtier_blocks_offered_total``: a holder's
  answers to ``remote_kv_source`` offers, and the host pages it pinned for them;
- gauges ``vllm:kvtier_supplies``, ``vllm:kvtier_supply_pages``,
  ``vllm:kvtier_host_referenced_pages``, ``vllm:kvtier_loads_in_flight``,
  ``vllm:kvtier_network_tasks``: zero (or the P2P server's own tasks) when idle, else a leak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS: dict[str, str] = {
    "blocks_supplied": "Blocks producer legs supplied under their kv_request_id.",
    "blocks_stored": "Supplied blocks copied from vLLM's KV cache (the rest were in host pages).",
    "fetch_bytes": "Payload bytes consumer fetches received over kvtier P2P.",
    "fetch_seconds": "Seconds consumer fetches took, summed.",
    "blocks_fetched": "Blocks consumer fetches received over kvtier P2P.",
    "blocks_loaded": "Blocks installed into vLLM's KV cache from host pages.",
    "blocks_recomputed": "Blocks of planned loads left to vLLM to recompute.",
    "fetch_failures": "Fetches that fell short (the rest of the prompt is recomputed).",
    "blocks_offloaded": "Prompt blocks copied into host pages under offload_prompts.",
    "offload_seconds": "Engine-thread seconds spent on offload_prompts copies, summed.",
    "offers_answered": "remote_kv_source offers this holder answered (any number held).",
    "blocks_offered": "Host pages this holder pinned for remote_kv_source offers.",
}
GAUGES: dict[str, str] = {
    "supplies": "kv_request_ids with supply held by this producer.",
    "supply_pages": "Host pages held by supplies.",
    "host_referenced_pages": "Host pages with a reader reference right now.",
    "loads_in_flight": "Consumer fetches not yet installed.",
    "network_tasks": "Tasks on the connector's network loop (server, sessions, fetches).",
}


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """``data``: counter deltas and gauge values, names as in :data:`COUNTERS` / :data:`GAUGES`."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in COUNTERS:
                self.data[name] = self.data.get(name, 0) + value
            else:
                self.data[name] = value  # gauges: the latest report wins
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data[name] for name in (*COUNTERS, *GAUGES) if name in self.data}

    def is_empty(self) -> bool:
        return not self.data


class KvtierPromMetrics(KVConnectorPromMetrics):
    """Counters and gauges of :class:`KvtierConnectorStats` on vLLM's ``/metrics``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvtier_{name}", documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(
                    name=f"vllm:kvtier_{name}",
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",
                ),
                per_engine_labelvalues,
            )
            for name, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters and value > 0:
                self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
