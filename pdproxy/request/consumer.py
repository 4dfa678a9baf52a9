"""The consumer leg of one request: ranked consumers, tried until one answers.

Failures before the consumer's first byte (connect, timeout, 5xx, 429) walk down the ranked
consumers under the shared retry policy. The first consumer that answers is committed: a whole
answer becomes a plain response, a stream becomes a :class:`~pdproxy.request.relay.Relay` that holds
the consumer until the stream ends.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from starlette.responses import Response

from pdproxy.errors import LegFailed, LegRefused, NoBackendAvailable
from pdproxy.fleet.backends import Backend
from pdproxy.fleet.dp_ranks import chosen_rank, with_rank_header
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.failover import MigratingRelay
from pdproxy.request.lease import RequestLease
from pdproxy.request.legs import ROUTE_PATHS, leg_headers
from pdproxy.request.relay import Relay, find_cached_tokens
from pdproxy.request.retry import NO_DEADLINE, RetryPolicy
from pdproxy.upstream.client import Upstream

if TYPE_CHECKING:
    from pdproxy.request.failover import MigrationPlan

log = logging.getLogger(__name__)

_RELAYED_HEADERS = ("content-type", "cache-control")


class ConsumerPhase:
    def __init__(
        self,
        upstream: Upstream,
        retry: RetryPolicy,
        metrics: ProxyMetrics,
        *,
        idle_s: float,
        server_timing: bool,
    ) -> None:
        self._upstream = upstream
        self._retry = retry
        self._metrics = metrics
        self._idle_s = idle_s
        self._server_timing = server_timing

    def most_legs(self, consumers: list[Backend]) -> int:
        """How many legs one :meth:`run` over ``consumers`` sends at most."""
        return min(len(consumers), self._retry.consumer_attempts)

    async def run(
        self,
        lease: RequestLease,
        leg: bytes,
        consumers: list[Backend],
        base: dict[str, str],
        stream: bool,
        *,
        plan: MigrationPlan | None = None,
        first_attempt: int = 0,
    ) -> Response | Relay:
        """``first_attempt``: the attempt number of the first leg (a later run for the same
        request starts past the legs an earlier one sent: each leg's id stays unique)."""
        canceller = lease.canceller
        assert canceller is not None
        path = ROUTE_PATHS[lease.route]
        t = time.perf_counter()
        failure: LegFailed | None = None
        ranks = lease.decision.consumer_ranks if lease.decision is not None else None
        for attempt, consumer in enumerate(
            consumers[: self.most_legs(consumers)], start=first_attempt
        ):
            if attempt:
                if not await self._retry.pause("consumer", attempt, NO_DEADLINE, canceller):
                    break
                lease.retries += 1
            headers = leg_headers(base, lease.request_id, "consumer", attempt, consumer.auth_header)
            with_rank_header(headers, chosen_rank(ranks, consumer.name))
            hold = lease.hold(consumer)
            try:
                with canceller.armed():
                    opened = await self._upstream.open_consumer_leg(
                        consumer, path, leg, headers, stream
                    )
            except LegFailed as exc:
                hold.failed(exc)
                hold.release()
                log.warning("request %s: consumer leg failed: %s", lease.request_id, exc)
                failure = exc
                continue
            except LegRefused:
                hold.refused()
                hold.release()
                lease.consumer = consumer.name
                raise
            except BaseException:
                hold.release()
                raise
            hold.succeeded()
            lease.consumer = consumer.name
            lease.consumer_first_byte_s = time.perf_counter() - t
            self._metrics.observe_ttfb(lease.route, time.perf_counter() - lease.t0)
            status = opened.response.status
            client_headers = lease.client_headers(self._server_timing)
            for name in _RELAYED_HEADERS:
                value = opened.response.headers.get(name)
                if value is not None:
                    client_headers[name] = value
            if opened.complete:
                hold.release()
                lease.cached_tokens = find_cached_tokens(opened.first)
                self._metrics.observe_leg("consumer", consumer.name, time.perf_counter() - t)
                return Response(opened.first, status_code=status, headers=client_headers)
            relay = Relay(
                upstream=opened.response,
                first=opened.first,
                status=status,
                headers=client_headers,
                hold=hold,
                canceller=canceller,
                idle_s=self._idle_s,
                t0=t,
            )
            if plan is not None:  # mid-stream failover (pdproxy.request.failover)
                tried = {c.name for c in consumers[: attempt - first_attempt + 1]}
                return MigratingRelay(relay, plan, consumers, tried, base)
            return relay
        raise failure or NoBackendAvailable("no consumer to try")
