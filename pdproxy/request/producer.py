"""The producer leg of one request: ranked producers, shared retry policy, bounded attempts.

A producer that fails (connect, timeout, 5xx, 429, an answer without usable
``kv_transfer_params``, or one naming a KV address other than the producer's configured
``kv_address``) has its supply released and the next one is tried, within the retry policy's
attempt count and time budget; ``None`` tells the caller to let the consumer prefill alone.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdproxy.errors import KvAddressMismatch, LegFailed, LegRefused
from pdproxy.fleet.backends import Backend
from pdproxy.fleet.dp_ranks import chosen_rank, offset_port, with_rank_header
from pdproxy.front.intake import ClientBody
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.lease import RequestLease
from pdproxy.request.legs import (
    ROUTE_PATHS,
    consumer_kv_params,
    leg_headers,
    new_kv_request_id,
    producer_body,
    producer_kv_params,
    with_kv_source,
)
from pdproxy.request.release import Supply
from pdproxy.request.retry import RetryPolicy
from pdproxy.routing.base import PullSource
from pdproxy.settings import Dialect
from pdproxy.upstream.client import Upstream

log = logging.getLogger(__name__)


class ProducerPhase:
    def __init__(self, upstream: Upstream, retry: RetryPolicy, metrics: ProxyMetrics) -> None:
        self._upstream = upstream
        self._retry = retry
        self._metrics = metrics

    async def run(
        self,
        lease: RequestLease,
        body: ClientBody,
        producers: list[Backend],
        dialect: Dialect,
        base: dict[str, str],
        *,
        kv_source: PullSource | None = None,
    ) -> dict[str, Any] | None:
        """The consumer's ``kv_transfer_params`` (the supply is then ``lease.supply``), or None
        when every attempt failed. ``kv_source``: each producer but the holder itself pulls
        the prefix from there first (p2p)."""
        canceller = lease.canceller
        assert canceller is not None
        path = ROUTE_PATHS[lease.route]
        t = time.perf_counter()
        deadline = t + self._retry.producer_budget_s
        ranks = lease.decision.producer_ranks if lease.decision is not None else None
        try:
            for attempt, producer in enumerate(producers[: self._retry.producer_attempts]):
                if attempt:
                    if not await self._retry.pause("producer", attempt, deadline, canceller):
                        break
                    lease.retries += 1
                kv_id = new_kv_request_id()
                rank = chosen_rank(ranks, producer.name)
                supply = Supply(producer, kv_id, dialect, rank)
                params = producer_kv_params(dialect, kv_id)
                if kv_source is not None and producer.name != kv_source.holder:
                    params = with_kv_source(params, kv_source)
                leg = producer_body(body, params)
                headers = leg_headers(
                    base, lease.request_id, "producer", attempt, producer.auth_header
                )
                with_rank_header(headers, rank)
                address = offset_port(producer.kv_address, rank)
                t_leg = time.perf_counter()
                hold = lease.hold(producer)
                try:
                    with canceller.armed():
                        answer = await self._upstream.producer_leg(producer, path, leg, headers)
                    kv_params = consumer_kv_params(dialect, producer.name, answer, kv_id, address)
                    hold.succeeded()
                except LegFailed as exc:
                    if isinstance(exc, KvAddressMismatch):
                        self._metrics.kv_address_mismatches.labels(producer.name).inc()
                    hold.failed(exc)
                    log.warning("request %s: producer leg failed: %s", lease.request_id, exc)
                    lease.drop_supply(supply)
                    continue
                except LegRefused:
                    hold.refused()
                    raise
                except BaseException:
                    lease.drop_supply(supply)
                    raise
                finally:
                    hold.release()
                self._metrics.observe_leg("producer", producer.name, time.perf_counter() - t_leg)
                lease.producer = producer.name
                lease.supply = supply
                return kv_params
            return None
        finally:
            lease.producer_s = time.perf_counter() - t
