"""Mid-stream failover: a consumer that fails after the first byte is replaced, unseen.

A streamed answer that may migrate (a :class:`~pdproxy.request.failover.MigrationPlan`:
``failover.max_migrations`` > 0 and a request
:func:`~pdproxy.request.continuation.migration_refusal` accepts) is relayed by
:class:`MigratingRelay` instead of :class:`~pdproxy.request.relay.Relay`: whole SSE events only,
each recorded in a
:class:`~pdproxy.request.continuation.StreamLedger`. When the consumer fails — the connection breaks
(also in the middle of an event, whose partial bytes are dropped), it sends an error event, it
ends without ``[DONE]``, or it stalls past ``timeouts.consumer_idle_s`` — the relay opens a
continuation leg (:mod:`pdproxy.request.continuation`) on the next routable consumer of the
request's ranked list that it has not tried, and goes on relaying it: its chunks take the first
leg's ``id``/``created``/``model``, its role chunk is dropped, its usage is shifted back to the
original prompt and every generated token. The client sees one stream; no byte is sent twice.

A consumer that fails after the last token (every choice finished) needs no new leg: the proxy
closes the stream itself (usage if asked, ``[DONE]``). A client that left is never migrated.
When no migration is left, none is possible, or no consumer answers, the stream ends with the
error event of a plain relay. Each outcome is counted in ``pdproxy_stream_migrations``.
Every leg holds its consumer (in flight, breaker) through its own hold from the request's lease
(:class:`~pdproxy.request.relay.StreamLease`), released when that leg ends; a failed leg makes
its consumer a suspect of the lease, as with a plain relay.

Which streams may migrate, and what a migrating stream knows of its request.

:class:`StreamFailover` (one per request path) turns ``failover.max_migrations`` and a request's
body into a :class:`MigrationPlan`, or None; the plan builds the first consumer leg (asking for
the running token count), each continuation leg (:mod:`pdproxy.request.continuation`) and the chunk
shapers of :class:`~pdproxy.request.failover.MigratingRelay`, which does the migrating.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import Counter
from starlette.types import Send

from pdproxy.errors import LegFailed, LegRefused
from pdproxy.fleet.backends import Backend
from pdproxy.front.cancel import CLIENT_DISCONNECT, CONSUMER_IDLE, IdleWatchdog
from pdproxy.front.intake import ClientBody, Endpoint
from pdproxy.front.responses import stream_error_event
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.continuation import (
    asked_token_ids,
    continuation_body,
    first_leg,
    migration_refusal,
)
from pdproxy.request.legs import leg_headers
from pdproxy.request.relay import LegHold, Relay, StreamEnd
from pdproxy.request.stream_ledger import (
    ChunkShaper,
    EventSplitter,
    StreamLedger,
    StreamNotFollowable,
    event_data,
)
from pdproxy.settings.proxy import FailoverSettings
from pdproxy.upstream.client import Upstream
from pdproxy.upstream.pool import HttpClientError
from pdproxy.upstream.pool import Response as UpstreamResponse

log = logging.getLogger(__name__)


class _ErrorEvent(Exception):
    """The consumer reported an error inside its stream."""


@dataclass(slots=True)
class _Leg:
    hold: LegHold
    response: UpstreamResponse
    first: bytes
    t0: float


class MigratingRelay(Relay):
    """A committed consumer stream that may move to another consumer (see module doc)."""

    __slots__ = ("_base", "_consumers", "_plan", "_tried")

    def __init__(
        self,
        relay: Relay,
        plan: MigrationPlan,
        consumers: Sequence[Backend],
        tried: set[str],
        base: dict[str, str],
    ) -> None:
        self.status_code = relay.status_code
        self.raw_headers = relay.raw_headers
        self._upstream = relay._upstream
        self._first = relay._first
        self._lease = relay._lease
        self._hold = relay._hold
        self._canceller = relay._canceller
        self._metrics = relay._metrics
        self._idle_s = relay._idle_s
        self._t0 = relay._t0
        self._plan = plan
        self._consumers = consumers
        self._tried = tried
        self._base = base

    async def run(self, send: Send) -> StreamEnd:
        lease = self._lease
        leg = _Leg(self._hold, self._upstream, self._first, self._t0)
        ledger = StreamLedger()
        shaper = self._plan.shaper(ledger, continuation=False)
        migrations = 0
        canceller = self._canceller
        failover = self._plan.failover
        try:
            try:
                with canceller.armed():
                    await send(
                        {"type": "http.response.start", "status": self.status_code,
                         "headers": self.raw_headers}
                    )  # fmt: skip
            except asyncio.CancelledError as exc:
                if not canceller.owns(exc):
                    raise
                self._end_leg(leg, CLIENT_DISCONNECT)
                return self._left(leg)
            while True:
                failure = await self._follow(send, leg, shaper)
                self._end_leg(leg, failure)
                if failure is None:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return StreamEnd(True, leg.hold.backend.name, ledger.cached_tokens, False)
                if failure == CLIENT_DISCONNECT or (
                    failure == CONSUMER_IDLE and not canceller.rearm(CONSUMER_IDLE)
                ):
                    log.info("request %s: client left mid-stream", lease.request_id)
                    return self._left(leg)
                if ledger.finished:
                    failover.migrations.labels("closed").inc()
                    log.info(
                        "request %s: consumer %s failed (%s) after the last token; stream "
                        "closed by the proxy", lease.request_id, leg.hold.backend.name, failure,
                    )  # fmt: skip
                    await self._send_end(send, shaper.closing_events())
                    return StreamEnd(True, leg.hold.backend.name, ledger.cached_tokens, False)
                why = self._why_not(ledger, migrations)
                body = b""
                if why is None:
                    made = self._plan.continuation(ledger)
                    if isinstance(made, str):
                        why = made
                    else:
                        body = made
                if why is not None:
                    outcome = "exhausted" if migrations >= failover.max_migrations else "refused"
                    failover.migrations.labels(outcome).inc()
                    log.warning(
                        "request %s: consumer %s failed mid-stream (%s); not migrated: %s",
                        lease.request_id, leg.hold.backend.name, failure, why,
                    )  # fmt: skip
                    await self._send_end(send, self._error(failure, ledger))
                    return StreamEnd(False, leg.hold.backend.name, None, False)
                nxt = await self._open_next(body, migrations)
                if nxt is None:
                    failover.migrations.labels("exhausted").inc()
                    log.warning(
                        "request %s: consumer %s failed mid-stream (%s); no consumer took over",
                        lease.request_id, leg.hold.backend.name, failure,
                    )  # fmt: skip
                    await self._send_end(send, self._error(failure, ledger))
                    return StreamEnd(False, leg.hold.backend.name, None, False)
                migrations += 1
                failover.migrations.labels("migrated").inc()
                log.warning(
                    "request %s: consumer %s failed mid-stream (%s) after %d tokens; migrated "
                    "to %s (%d/%d)", lease.request_id, leg.hold.backend.name, failure,
                    ledger.completion_tokens, nxt.hold.backend.name, migrations,
                    failover.max_migrations,
                )  # fmt: skip
                leg = nxt
                shaper = self._plan.shaper(ledger, continuation=True)
        except asyncio.CancelledError as exc:
            if not canceller.owns(exc):
                raise
            log.info("request %s: client left while the stream migrated", lease.request_id)
            return self._left(leg)
        finally:
            if leg.hold.open:  # an exception on the way out: this leg was never ended
                self._end_leg(leg, "relay_error")

    def _left(self, leg: _Leg) -> StreamEnd:
        return StreamEnd(False, leg.hold.backend.name, None, True)

    def _why_not(self, ledger: StreamLedger, migrations: int) -> str | None:
        if migrations >= self._plan.failover.max_migrations:
            return "no migration left"
        if ledger.done_sent:
            return "stream already ended"
        return None

    def _error(self, failure: str, ledger: StreamLedger) -> bytes:
        ledger.done_sent = True
        return stream_error_event(f"consumer stream ended early: {failure}", failure)

    async def _send_end(self, send: Send, body: bytes) -> None:
        try:
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError:  # the client went while we closed its stream: nothing left to tell
            log.debug("client gone while its stream was being closed")

    async def _follow(self, send: Send, leg: _Leg, shaper: ChunkShaper) -> str | None:
        """Relay one leg's events until it ends; the failure, or None for a whole stream."""
        canceller = self._canceller
        splitter = EventSplitter()
        ledger = shaper.ledger
        watchdog: IdleWatchdog | None = None
        read = leg.response.read_chunk
        failure: str | None = None
        try:
            with canceller.armed():
                watchdog = IdleWatchdog(canceller, self._idle_s)
                chunk = leg.first
                while True:
                    for event in splitter.feed(chunk):
                        out = self._shape(event, shaper)
                        if out:
                            await send({"type": "http.response.body", "body": out,
                                        "more_body": True})  # fmt: skip
                    watchdog.touch()  # the idle clock runs only while we wait on the consumer
                    chunk = await read()
                    if not chunk:
                        break
        except asyncio.CancelledError as exc:
            if not canceller.owns(exc):
                raise
            failure = canceller.reason
        except HttpClientError as exc:
            log.warning("request %s: consumer stream broke: %r", self._lease.request_id, exc)
            failure = "consumer_stream_broken"
        except StreamNotFollowable:
            failure = "consumer_stream_unfollowable"
        except _ErrorEvent:
            failure = "consumer_error_event"
        finally:
            if watchdog is not None:
                watchdog.cancel()
        if failure is None and not ledger.done_sent:
            failure = "consumer_stream_truncated"
        if failure is not None and failure != CLIENT_DISCONNECT and ledger.done_sent:
            return None  # the client has the whole answer; only the connection's end was lost
        return failure

    def _shape(self, event: bytes, shaper: ChunkShaper) -> bytes | None:
        data = event_data(event)
        ledger = shaper.ledger
        if ledger.done_sent:
            return None  # nothing after [DONE] reaches the client
        if data is None:
            return event  # a comment or another field: relayed as is
        if data.strip() == b"[DONE]":
            if not ledger.finished:
                raise _ErrorEvent  # an answer that stops unfinished is a failed one
            return shaper.closing_events()
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise StreamNotFollowable("an event is not JSON") from exc
        if not isinstance(chunk, dict):
            raise StreamNotFollowable("an event is not a JSON object")
        if "error" in chunk:
            raise _ErrorEvent
        return shaper.shape(chunk)

    def _end_leg(self, leg: _Leg, failure: str | None) -> None:
        if failure is not None or not leg.response.at_eof:
            leg.response.close()
        else:
            leg.response.release()
        if not leg.hold.open:
            return
        leg.hold.release()
        name = leg.hold.backend.name
        self._metrics.observe_leg("consumer", name, time.perf_counter() - leg.t0)
        if failure is not None and failure not in (CLIENT_DISCONNECT, "relay_error"):
            self._lease.suspect(leg.hold.backend, failure)

    async def _open_next(self, body: bytes, migrations: int) -> _Leg | None:
        """A continuation leg on the next consumer not tried yet (client leaving cancels)."""
        lease = self._lease
        failover = self._plan.failover
        path = self._plan.endpoint.path
        attempt = failover.first_attempts + migrations * len(self._consumers)
        for consumer in self._consumers:
            if consumer.name in self._tried or not consumer.routable:
                continue
            self._tried.add(consumer.name)
            headers = leg_headers(
                self._base, lease.request_id, "consumer", attempt, consumer.auth_header
            )
            attempt += 1
            hold = lease.hold(consumer)
            t0 = time.perf_counter()
            try:
                with self._canceller.armed():
                    opened = await failover.upstream.open_consumer_leg(
                        consumer, path, body, headers, True
                    )
            except LegFailed as exc:
                hold.failed(exc)
                hold.release()
                log.warning("request %s: continuation leg failed: %s", lease.request_id, exc)
                continue
            except LegRefused as exc:
                hold.refused()
                hold.release()
                log.warning(
                    "request %s: continuation refused by %s: %s %s", lease.request_id,
                    consumer.name, exc.status, exc.body[:200],
                )  # fmt: skip
                return None  # the same body is refused everywhere
            except BaseException:
                hold.release()
                raise
            if opened.complete:  # a whole answer to a stream request: not a stream to follow
                hold.release()
                continue
            hold.succeeded()
            return _Leg(hold, opened.response, opened.first, t0)
        return None


log = logging.getLogger(__name__)


class StreamFailover:
    """One per request path: decides which streams may migrate and counts what happened."""

    def __init__(
        self,
        settings: FailoverSettings,
        upstream: Upstream,
        metrics: ProxyMetrics,
        *,
        first_attempts: int,
    ) -> None:
        self._settings = settings
        self._upstream = upstream
        self._first_attempts = first_attempts
        self.migrations = Counter(
            "pdproxy_stream_migrations",
            "Consumer failures after a stream's first byte, by what the proxy did: migrated "
            "(a continuation leg took over), closed (the answer was complete; the proxy ended "
            "the stream), refused (the request cannot continue exactly), exhausted (no "
            "migration left or no consumer answered)",
            ["outcome"],
            registry=metrics.registry,
        )

    def plan(self, endpoint: Endpoint, body: ClientBody, stream: bool) -> MigrationPlan | None:
        """The request's migration plan; None when failover is off or the answer is whole."""
        if not stream or self._settings.max_migrations == 0:
            return None
        refusal = migration_refusal(endpoint, body.data)
        if refusal is not None:
            log.debug("stream of route %s will not migrate: %s", endpoint, refusal)
            return None
        opts = body.data.get("stream_options")
        opts = opts if isinstance(opts, dict) else {}
        return MigrationPlan(
            failover=self,
            endpoint=endpoint,
            body=body,
            client_usage=opts.get("include_usage") is True,
            client_continuous=opts.get("include_usage") is True
            and opts.get("continuous_usage_stats") is True,
            client_token_ids=asked_token_ids(body.data),
            token_ids=self._settings.token_ids,
        )

    @property
    def max_migrations(self) -> int:
        return self._settings.max_migrations

    @property
    def upstream(self) -> Upstream:
        return self._upstream

    @property
    def first_attempts(self) -> int:
        return self._first_attempts


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """What a migrating stream needs to know of its request."""

    failover: StreamFailover
    endpoint: Endpoint
    body: ClientBody
    client_usage: bool
    client_continuous: bool
    client_token_ids: bool = False
    """The client asked for ``token_ids`` itself (else the proxy strips them)."""
    token_ids: bool = False
    """Ask every leg for token ids, so a continuation resumes from ids (``failover.token_ids``)."""

    def first_leg(self, kv_params: dict[str, Any] | None) -> bytes:
        data = first_leg(self.body.data, self.token_ids)
        if kv_params is not None:
            data["kv_transfer_params"] = kv_params
        return self.body.encode(data)

    def continuation(self, ledger: StreamLedger) -> bytes | str:
        made = continuation_body(self.endpoint, self.body.data, ledger, self.token_ids)
        return made if isinstance(made, str) else self.body.encode(made)

    def shaper(self, ledger: StreamLedger, continuation: bool) -> ChunkShaper:
        return ChunkShaper(
            ledger,
            continuation=continuation,
            client_usage=self.client_usage,
            client_continuous=self.client_continuous,
            client_token_ids=self.client_token_ids,
        )
