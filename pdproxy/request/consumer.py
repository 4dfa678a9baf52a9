"""The consumer leg of one request: ranked consumers, tried until one answers.

Failures before the consumer's first byte (connect, timeout, 5xx, 429) walk down the ranked
consumers under the shared retry policy. The first consumer that answers is committed: a whole
answer becomes a plain response, a stream becomes a :class:`~pdproxy.request.relay.Relay` that
holds the consumer until the stream ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.responses import Response

from pdproxy.errors import LegFailed, LegRefused, NoBackendAvailable
from pdproxy.fleet.backends import Backend
from pdproxy.fleet.dp_ranks import with_rank_header
from pdproxy.front.responses import relayed_response
from pdproxy.front.tenants import hide_cached_tokens
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.failover import MigratingRelay
from pdproxy.request.lease import RequestLease
from pdproxy.request.legs import leg_headers
from pdproxy.request.record import RequestRecord
from pdproxy.request.relay import Relay, find_cached_tokens
from pdproxy.request.retry import NO_DEADLINE, RetryPolicy
from pdproxy.upstream.client import Upstream

if TYPE_CHECKING:
    from pdproxy.request.failover import MigrationPlan

log = logging.getLogger(__name__)

_RELAYED_HEADERS = ("content-type", "cache-control")


@dataclass(frozen=True, slots=True)
class ConsumerResult:
    """The consumer that answered, and its answer as the client will get it (before the
    request's own headers, which the path adds)."""

    consumer: str
    answer: Response | Relay
    first_byte_s: float
    """From the phase's start to the consumer's first byte (Server-Timing ``consumer_fb``)."""
    cached_tokens: int | None
    """From a whole answer; a stream's are known when its relay ends."""


class ConsumerPhase:
    """One per request path; :meth:`run` once or twice per request, on the event loop."""

    def __init__(
        self,
        upstream: Upstream,
        retry: RetryPolicy,
        metrics: ProxyMetrics,
        *,
        idle_s: float,
    ) -> None:
        self._upstream = upstream
        self._retry = retry
        self._metrics = metrics
        self._idle_s = idle_s

    def most_legs(self, consumers: Sequence[Backend]) -> int:
        """How many legs one :meth:`run` over ``consumers`` sends at most."""
        return min(len(consumers), self._retry.consumer_attempts)

    async def run(
        self,
        lease: RequestLease,
        record: RequestRecord,
        leg: bytes,
        consumers: Sequence[Backend],
        *,
        ranks: Mapping[str, int],
        base: dict[str, str],
        stream: bool,
        plan: MigrationPlan | None = None,
        first_attempt: int = 0,
    ) -> ConsumerResult:
        """Send ``leg`` down ``consumers`` until one answers; raises the last
        :class:`~pdproxy.errors.LegFailed` when none did, :class:`~pdproxy.errors.LegRefused`
        at once for a 4xx. Each attempt holds its consumer through ``lease``; retries are
        counted into ``record``. ``first_attempt``: the attempt number of the first leg (a
        later run for the same request starts past the legs an earlier one sent: each leg's id
        stays unique)."""
        canceller = lease.canceller
        assert canceller is not None
        path = record.endpoint.path
        request_id = record.request_id
        t = time.perf_counter()
        failure: LegFailed | None = None
        # Slicing bounds the attempts as most_legs() does, without a call per request.
        for attempt, consumer in enumerate(
            consumers[: self._retry.consumer_attempts], start=first_attempt
        ):
            if attempt:
                if not await self._retry.pause("consumer", attempt, NO_DEADLINE, canceller):
                    break
                record.retries += 1
            headers = leg_headers(base, request_id, "consumer", attempt, consumer.auth_header)
            rank = ranks.get(consumer.name)
            if rank is not None:
                with_rank_header(headers, rank)
            hold = lease.hold(consumer)
            try:
                with canceller.armed():
                    opened = await self._upstream.open_consumer_leg(
                        consumer, path, leg, headers, stream
                    )
            except LegFailed as exc:
                hold.failed(exc)
                hold.release()
                log.warning("request %s: consumer leg failed: %s", request_id, exc)
                failure = exc
                continue
            except LegRefused:
                hold.refused()
                hold.release()
                raise
            except BaseException:
                hold.release()
                raise
            hold.succeeded()
            first_byte = time.perf_counter()
            self._metrics.observe_ttfb(record.endpoint, first_byte - record.t0)
            status = opened.response.status
            relayed = {}
            for name in _RELAYED_HEADERS:
                value = opened.response.headers.get(name)
                if value is not None:
                    relayed[name] = value
            if opened.complete:
                hold.release()
                self._metrics.observe_leg("consumer", consumer.name, time.perf_counter() - t)
                return ConsumerResult(
                    consumer.name,
                    relayed_response(
                        hide_cached_tokens(opened.first)
                        if record.hides_cached_tokens
                        else opened.first,
                        status,
                        relayed,
                    ),
                    first_byte - t,
                    find_cached_tokens(opened.first),
                )
            relay = Relay(
                upstream=opened.response,
                first=opened.first,
                status=status,
                headers=relayed,
                lease=lease,
                hold=hold,
                canceller=canceller,
                metrics=self._metrics,
                idle_s=self._idle_s,
                t0=t,
            )
            if plan is not None:  # mid-stream failover (pdproxy.request.failover)
                tried = {c.name for c in consumers[: attempt - first_attempt + 1]}
                relay = MigratingRelay(relay, plan, consumers, tried, base)
            return ConsumerResult(consumer.name, relay, first_byte - t, None)
        raise failure or NoBackendAvailable("no consumer to try")
