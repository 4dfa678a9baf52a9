"""Prometheus metrics of the KV-aware router (registered on the registry it is given)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.events.subscriber import SubscriberStats
from kvtier.residency.translate import TranslateStats
from pdproxy.routing.base import RequestOutcome, RouteDecision

_ROUTE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
)  # fmt: skip
_DRIFT_BUCKETS = (
    -8192.0, -2048.0, -512.0, -128.0, -32.0, -1.0, 0.0, 31.0, 127.0, 511.0, 2047.0, 8191.0,
)  # fmt: skip


class KvRouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.decisions = Counter(
            "pdproxy_kv_router_decisions",
            "Routing decisions by reason (kv-prefix, load, hot-spot, short-suffix, load-only...)",
            ["reason"],
            registry=r,
        )
        self.route_seconds = Histogram(
            "pdproxy_kv_router_route_seconds",
            "Time to decide (tokenize, hash, match, score, record)",
            buckets=_ROUTE_BUCKETS,
            registry=r,
        )
        self.unhashable = Counter(
            "pdproxy_kv_router_unhashable",
            "Requests routed by load alone because they could not be hashed",
            ["reason"],
            registry=r,
        )
        self.shared_state_up = Gauge(
            "pdproxy_kv_router_shared_state_up",
            "1 while the shared store (Redis) answers, 0 while routing falls back to load alone",
            registry=r,
        )
        self.shared_state_up.set(1)
        self.fallbacks = Counter(
            "pdproxy_kv_router_fallbacks",
            "Decisions made by load alone because the shared store failed or its breaker was open",
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "pdproxy_kv_router_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen consumers to find cached",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdproxy_kv_router_prompt_tokens",
            "Prompt tokens of hashed requests (denominator of the predicted hit rate)",
            registry=r,
        )
        self.cached_tokens_drift = Histogram(
            "pdproxy_kv_router_cached_tokens_drift",
            "Engine-reported cached_tokens minus the router's prediction for the chosen consumer; "
            "a persistent offset means hash or tokenizer drift",
            ["mode"],
            buckets=_DRIFT_BUCKETS,
            registry=r,
        )
        self.prediction_checks = Counter(
            "pdproxy_kv_router_prediction_checks",
            "Requests whose predicted cached tokens were compared with the engine's report, by "
            "leg (consumer, producer) and result: exact, block (off by less than one block), "
            "off (one block or more); accuracy = (exact + block) / all",
            ["leg", "result"],
            registry=r,
        )
        self.offloaded_hashes = Counter(
            "pdproxy_kv_router_offloaded_hashes",
            "Prompts hashed in a thread (more than inline_hash_blocks blocks)",
            registry=r,
        )
        self.event_apply_errors = Counter(
            "pdproxy_kv_router_event_apply_errors",
            "KV event batches the index could not apply (the node is forgotten on recovery)",
            registry=r,
        )
        self.events_rank_refused = Counter(
            "pdproxy_kv_router_events_rank_refused",
            "KV event batches dropped because their data_parallel_rank is not their socket's "
            "rank (out of range, or another rank's), by node",
            ["node"],
            registry=r,
        )

    def follow_feeds(self, feeds: FollowedFeeds, index: object) -> None:
        """Export per node what its subscription dropped and what the index evicted (read at
        scrape time). ``index``: its ``translate_stats(node)`` is read when it has one."""
        self.registry.register(_FeedCollector(feeds, index))


class _Subscriber(Protocol):
    @property
    def stats(self) -> SubscriberStats: ...


class FollowedFeeds(Protocol):
    """What the collector reads of :class:`~pdproxy.routing.kv.event_feeds.EventFeeds`."""

    @property
    def nodes(self) -> Sequence[str]: ...

    def subscriber(self, node: str) -> _Subscriber | None: ...


class _FeedCollector(Collector):
    def __init__(self, feeds: FollowedFeeds, index: object) -> None:
        self._feeds = feeds
        self._index = index

    def collect(self) -> Iterator[Metric]:
        disconnects = CounterMetricFamily(
            "pdproxy_kv_router_event_disconnects",
            "KV event connections to a node's publisher that dropped (its restart, the network, "
            "or a message over event_max_message_bytes), by node",
            labels=["node"],
        )
        replay_timeouts = CounterMetricFamily(
            "pdproxy_kv_router_event_replay_timeouts",
            "KV event replays that did not end in time (or answered over "
            "event_max_message_bytes), by node",
            labels=["node"],
        )
        evicted = CounterMetricFamily(
            "pdproxy_kv_router_index_evicted_blocks",
            "Engine blocks of a node forgotten, oldest first, to keep it within "
            "max_blocks_per_node, by node",
            labels=["node"],
        )
        translate_stats = getattr(self._index, "translate_stats", None)
        for node in self._feeds.nodes:
            sub = self._feeds.subscriber(node)
            if sub is not None:
                disconnects.add_metric([node], sub.stats.disconnects)
                replay_timeouts.add_metric([node], sub.stats.replay_timeouts)
            if callable(translate_stats):
                stats = translate_stats(node)
                if isinstance(stats, TranslateStats):
                    evicted.add_metric([node], stats.evicted)
        yield from (disconnects, replay_timeouts, evicted)


@dataclass(frozen=True, slots=True)
class PredictionCheck:
    """One leg of one request: what the router predicted its engine would find cached, and
    what the engine reported (``usage.prompt_tokens_details.cached_tokens``)."""

    leg: str
    """``consumer`` or ``producer``."""
    node: str
    predicted: int
    reported: int

    @property
    def drift(self) -> int:
        return self.reported - self.predicted

    def result(self, block_size: int) -> str:
        if self.drift == 0:
            return "exact"
        return "block" if abs(self.drift) < block_size else "off"


def prediction_checks(
    decision: RouteDecision[Any], outcome: RequestOutcome
) -> list[PredictionCheck]:
    """The request's legs whose prediction can be checked: the engine reported its cached
    tokens and served the request on the node the prediction was about (a retry or failover
    target was not predicted)."""
    if not outcome.ok:
        return []
    checks = []
    consumer = decision.consumers[0].name if decision.consumers else None
    predicted = decision.predicted_cached_tokens
    reported = outcome.cached_tokens
    if (
        predicted is not None
        and reported is not None
        and consumer is not None
        and outcome.consumer == consumer
    ):
        checks.append(PredictionCheck("consumer", consumer, predicted, reported))
    producer = decision.producers[0].name if decision.producers else None
    predicted = decision.predicted_producer_cached_tokens
    reported = outcome.producer_cached_tokens
    if (
        predicted is not None
        and reported is not None
        and producer is not None
        and outcome.producer == producer
    ):
        checks.append(PredictionCheck("producer", producer, predicted, reported))
    return checks


def observe_drift(
    metrics: KvRouterMetrics,
    decision: RouteDecision[Any],
    outcome: RequestOutcome,
    mode: str,
    block_size: int,
) -> list[PredictionCheck]:
    """Engine-reported cached tokens minus the prediction, per leg: the consumer's under
    ``mode`` (``pd``/``alone``), the producer's under ``producer``; each counted by how close
    it came. Returns the checks (the router logs them)."""
    checks = prediction_checks(decision, outcome)
    for check in checks:
        label = mode if check.leg == "consumer" else "producer"
        metrics.cached_tokens_drift.labels(label).observe(check.drift)
        metrics.prediction_checks.labels(check.leg, check.result(block_size)).inc()
    return checks
