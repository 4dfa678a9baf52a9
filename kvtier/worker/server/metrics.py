"""Prometheus metrics of one worker, read from its live state at scrape time (no globals)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvtier.p2p.admission import ServerStats
from kvtier.p2p.offer import OfferStats
from kvtier.worker.latency import TokenLatencies
from kvtier.worker.p2p_connector import P2PConnector
from kvtier.worker.worker import Worker

_COUNTERS = {
    "prompt_tokens": "Prompt tokens of admitted requests",
    "prefix_hit_tokens": "Prompt tokens served from the device prefix cache",
    "generated_tokens": "Tokens generated",
    "finished_requests": "Requests finished normally",
    "aborted_requests": "Requests aborted (client gone or shutdown)",
    "failed_requests": "Requests failed by the engine",
    "recomputed_tokens": "Tokens a consumer leg recomputed that its producer should have supplied",
    "p2p_bytes_fetched": "Bytes fetched from producers over P2P",
    "p2p_blocks_fetched": "Blocks fetched from producers over P2P",
    "p2p_fetch_failures": "Consumer legs whose P2P fetch fell short",
    "kv_params_fallbacks": "Legs with malformed or unreachable kv_transfer_params run locally",
    "p2p_blocks_supplied": "Blocks producer legs offered to the P2P tier",
    "kv_params_refused": "Legs refused (400): id over the length cap or producer not allowed",
    "unauthorized_requests": "Requests refused (401): missing or wrong API key",
    "oversized_bodies": "Requests refused (413): body over max_body_bytes",
    "pull_requests": "Legs that asked a holder for prefix blocks they lacked (remote_kv_source)",
    "pull_blocks": "Blocks pulled from holders over P2P",
    "pull_bytes": "Bytes pulled from holders over P2P",
    "pull_failures": "Pulls that fell short for a transport, verify or deadline problem",
    "pull_short": "Pulls whose holder held fewer blocks than asked (it lacks the tail)",
    "pull_seconds": "Wall seconds of pulls that moved bytes (offer, fetch and done)",
}


class WorkerCollector(Collector):
    """Exports engine gauges and counters of one :class:`Worker`."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        engine = self._worker.engine
        prefix = "kvtier_worker_"
        yield GaugeMetricFamily(prefix + "running_requests", "Requests running", engine.num_running)
        yield GaugeMetricFamily(prefix + "waiting_requests", "Requests waiting", engine.num_waiting)
        usage = GaugeMetricFamily(
            prefix + "kv_usage_ratio", "Used fraction of each KV pool", labels=["group"]
        )
        cached = GaugeMetricFamily(
            prefix + "kv_cached_blocks", "Blocks in each pool's prefix cache", labels=["group"]
        )
        for pool in engine.kv.pools:
            usage.add_metric([str(pool.spec.index)], pool.usage)
            cached.add_metric([str(pool.spec.index)], pool.num_cached)
        yield usage
        yield cached
        referenced = GaugeMetricFamily(
            prefix + "kv_referenced_pages",
            "Device pages of each pool held by a request (leak check: 0 when idle)",
            labels=["group"],
        )
        for pool in engine.kv.pools:
            referenced.add_metric([str(pool.spec.index)], sum(1 for r in pool.refcounts() if r))
        yield referenced
        yield from self._resources()
        stats = self._worker.stats
        for name, doc in _COUNTERS.items():
            yield CounterMetricFamily(prefix + name, doc, value=getattr(stats, name))
        yield from _latency_metrics(stats.latencies)
        publisher = self._worker.events.publisher
        if publisher is not None:
            yield CounterMetricFamily(
                prefix + "kv_events_refused_clients",
                "KV event subscribers refused by CURVE (key not admitted)",
                value=publisher.refused_clients,
            )

    def _resources(self) -> Iterator[Metric]:
        """Gauges that return to their idle values when nothing leaks (supplies, pins, tasks)."""
        prefix = "kvtier_worker_"
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped outside the event loop
            tasks = 0
        yield GaugeMetricFamily(prefix + "asyncio_tasks", "Live asyncio tasks", tasks)
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            fds = 0
        yield GaugeMetricFamily(prefix + "open_fds", "Open file descriptors", fds)
        conn = self._worker.connector
        if not isinstance(conn, P2PConnector):
            return
        supply = conn.registry.stats()
        pool = conn.pool.stats()
        yield GaugeMetricFamily(
            prefix + "p2p_supplies", "Producer supplies held (kv_request_ids)", supply.requests
        )
        yield GaugeMetricFamily(
            prefix + "p2p_supply_pages", "Host pages held by producer supplies", supply.held_pages
        )
        yield GaugeMetricFamily(
            prefix + "p2p_sending_pages", "Host pages pinned by a send right now", supply.sending
        )
        yield GaugeMetricFamily(
            prefix + "host_referenced_pages", "Host pages with a reference", pool.referenced
        )
        yield GaugeMetricFamily(
            prefix + "host_writing_pages", "Host pages with a write in flight", pool.writing
        )
        yield GaugeMetricFamily(
            prefix + "offload_requests",
            "Requests the tiering manager tracks",
            conn.manager.stats().requests,
        )
        if conn.server is not None:
            yield from _p2p_server_metrics(conn.server.stats())
            if conn.server.offers is not None:
                yield from _offer_metrics(conn.server.offers.stats())


def _latency_metrics(latencies: TokenLatencies) -> Iterator[Metric]:
    prefix = "kvtier_worker_"
    for name, doc, hist in (
        ("time_to_first_token_seconds", "Arrival to first sampled token",
         latencies.time_to_first_token),
        ("inter_token_latency_seconds", "Time between consecutive tokens of a request",
         latencies.inter_token),
        ("time_per_output_token_seconds", "A finished request's decode time per token after "
         "the first", latencies.time_per_output_token),
    ):  # fmt: skip
        yield HistogramMetricFamily(
            prefix + name, doc, buckets=hist.cumulative(), sum_value=hist.total
        )


_P2P_SERVER_GAUGES = {
    "handshakes": "P2P connections open now that have not authenticated yet",
    "sessions": "Authenticated P2P sessions open now",
}
_P2P_SERVER_COUNTERS = {
    "accepted": "P2P connections accepted",
    "authenticated": "P2P handshakes that authenticated",
    "refused": "P2P handshakes refused (version, fingerprint, proof, loopback-only, busy)",
    "busy": "Authenticated P2P peers refused because max_connections sessions were open",
    "throttled": "P2P connections closed on accept by the per-peer rate limit or pending cap",
    "evicted": "Unauthenticated P2P connections closed to admit a newer one (pending set full)",
    "handshake_failures": "P2P handshakes that timed out, sent a malformed frame or hung up",
    "protocol_errors": "Authenticated P2P sessions closed for a malformed or unexpected frame",
    "integrity_failures": "P2P frames or blocks whose MAC did not verify",
}


def _p2p_server_metrics(stats: ServerStats) -> Iterator[Metric]:
    """The producer's P2P listener: refusals are counted here, never logged per connection."""
    prefix = "kvtier_worker_p2p_server_"
    for name, doc in _P2P_SERVER_GAUGES.items():
        yield GaugeMetricFamily(prefix + name, doc, getattr(stats, name))
    for name, doc in _P2P_SERVER_COUNTERS.items():
        yield CounterMetricFamily(prefix + name, doc, value=getattr(stats, name + "_total"))


def _offer_metrics(stats: OfferStats) -> Iterator[Metric]:
    """The holder side of symmetric pull (offers this node answered)."""
    prefix = "kvtier_worker_p2p_"
    yield CounterMetricFamily(prefix + "offers", "P2P offers answered", value=stats.offers_total)
    yield CounterMetricFamily(
        prefix + "offered_blocks", "Blocks pinned for P2P offers", value=stats.offered_keys_total
    )
    yield CounterMetricFamily(
        prefix + "offers_refused",
        "P2P offers that closed their session (too many keys, too many open, mid-fetch)",
        value=stats.refused_total,
    )


def worker_registry(worker: Worker) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(worker))
    return registry
