"""The producer leg of one request: ranked producers, shared retry policy, bounded attempts.

A producer that fails (connect, timeout, 5xx, 429, an answer without usable
``kv_transfer_params``, or one naming a KV address other than the producer's configured
``kv_address``) has its supply released and the next one is tried, within the retry policy's
attempt count and time budget; ``None`` tells the caller to let the consumer prefill alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdproxy.errors import KvAddressMismatch, LegFailed, LegRefused
from pdproxy.fleet.backends import Backend
from pdproxy.fleet.dp_ranks import offset_port, with_rank_header
from pdproxy.front.intake import ClientBody
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.lease import RequestLease
from pdproxy.request.legs import (
    consumer_kv_params,
    leg_headers,
    new_kv_request_id,
    producer_body,
    producer_kv_params,
    with_kv_source,
)
from pdproxy.request.record import RequestRecord
from pdproxy.request.relay import find_cached_tokens
from pdproxy.request.release import Supply
from pdproxy.request.retry import RetryPolicy
from pdproxy.routing.base import PullSource
from pdproxy.settings import Dialect
from pdproxy.upstream.client import Upstream

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProducerResult:
    """A producer that served the producer leg."""

    producer: str
    kv_params: dict[str, Any]
    """The consumer leg's ``kv_transfer_params``."""
    supply: Supply
    """What the producer holds for the consumer (kept by the lease until the request ends)."""
    cached_tokens: int | None = None
    """The producer's own prefix-cache hit (its answer's ``cached_tokens``), when reported."""


class ProducerPhase:
    """One per request path; :meth:`run` once per request that has producers, on the event loop."""

    def __init__(self, upstream: Upstream, retry: RetryPolicy, metrics: ProxyMetrics) -> None:
        self._upstream = upstream
        self._retry = retry
        self._metrics = metrics

    async def run(
        self,
        lease: RequestLease,
        record: RequestRecord,
        body: ClientBody,
        producers: Sequence[Backend],
        *,
        ranks: Mapping[str, int],
        dialect: Dialect,
        base: dict[str, str],
        kv_source: PullSource | None = None,
    ) -> ProducerResult | None:
        """The producer that answered, or None when every attempt failed. Each attempt holds
        its producer through ``lease``; the supply of the one that answered is kept there
        (``lease.supply``), the others' are released at once. Retries are counted into
        ``record``. ``ranks``: the data-parallel rank chosen on each producer; ``base``: every
        leg's headers; ``kv_source``: each producer but the holder itself pulls the prefix from
        there first (p2p)."""
        canceller = lease.canceller
        assert canceller is not None
        path = record.endpoint.path
        request_id = record.request_id
        deadline = time.perf_counter() + self._retry.producer_budget_s
        for attempt, producer in enumerate(producers[: self._retry.producer_attempts]):
            if attempt:
                if not await self._retry.pause("producer", attempt, deadline, canceller):
                    break
                record.retries += 1
            kv_id = new_kv_request_id()
            rank = ranks.get(producer.name)
            supply = Supply(producer, kv_id, dialect, rank)
            params = producer_kv_params(dialect, kv_id)
            if kv_source is not None and producer.name != kv_source.holder:
                params = with_kv_source(params, kv_source)
            leg = producer_body(body, params)
            headers = leg_headers(base, request_id, "producer", attempt, producer.auth_header)
            if rank is not None:
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
                log.warning("request %s: producer leg failed: %s", request_id, exc)
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
            lease.supply = supply
            return ProducerResult(producer.name, kv_params, supply, find_cached_tokens(answer))
        return None
