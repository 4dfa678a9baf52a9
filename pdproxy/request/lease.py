"""One owner per request: :class:`RequestLease`, closed exactly once on every path.

A request takes things that must be given back: its admission slot, one in-flight count per
backend leg (:class:`BackendHold`), the P2P supplies producers may hold for it, the router's
ticket (``router.finished``) and its disconnect watcher. The lease holds all of them and
:meth:`RequestLease.close` gives every one back. The request path hands the server a
:class:`LeasedResponse`: a plain response closes the lease once sent, a relayed stream once the
stream ends or the client leaves. Nothing else releases anything.

Breaker attribution also lives here, because only the end of a request tells whose fault a
failure was. A leg that failed (transport error, timeout, 5xx, 429) makes its backend a
*suspect*. At close, a request that succeeded after all (on another backend, or the consumer
alone) confirms its suspects: the same request worked elsewhere, so each suspect gets
``record_failure``. A request that failed everywhere proves nothing about any one backend (one
malformed input makes every engine answer 500), so each suspect is instead health-checked at
once and the breaker counts the failure only if the check fails too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdproxy.errors import KvAddressMismatch, LegFailed
from pdproxy.fleet.backends import Backend
from pdproxy.front.admission import Admission, ModelSlot
from pdproxy.front.cancel import RequestCanceller
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.ids import REQUEST_ID_HEADER, RequestId, leg_request_id
from pdproxy.request.relay import Relay
from pdproxy.request.release import Supply, SupplyReleaser
from pdproxy.routing.base import RequestOutcome, RouteDecision, Router

if TYPE_CHECKING:
    from pdproxy.request.trace import RequestTrace

log = logging.getLogger(__name__)

FALLBACK_HEADER = "x-pdproxy-fallback"
RETRIES_HEADER = "x-pdproxy-retries"


def failure_kind(exc: LegFailed) -> str:
    """A low-cardinality label for a failed leg (metrics)."""
    if isinstance(exc, KvAddressMismatch):
        return "kv_address"
    if exc.timed_out:
        return "timeout"
    if exc.status is not None:
        return "status_5xx" if exc.status >= 500 else f"status_{exc.status}"
    return "transport"


class BackendHold:
    """One leg on one backend: counted in flight (and as the breaker's half-open probe) from
    creation until :meth:`release`, which the lease also calls at close (idempotent)."""

    __slots__ = ("_lease", "_settled", "backend", "open")

    def __init__(self, backend: Backend, lease: RequestLease) -> None:
        backend.begin()
        self.backend = backend
        self._lease = lease
        self.open = True
        self._settled = False

    def succeeded(self) -> None:
        self._settled = True
        self.backend.breaker.record_success()

    def refused(self) -> None:
        """A 4xx: the request's own fault; no verdict on the backend (frees a probe slot)."""
        self._settled = True
        self.backend.breaker.record_abandoned()

    def failed(self, exc: LegFailed) -> None:
        """A suspect until the request's end says whose fault it was."""
        self._settled = True
        self.backend.breaker.record_abandoned()
        self._lease.suspect(self.backend, failure_kind(exc))

    def release(self) -> None:
        if self.open:
            self.open = False
            self.backend.end()
            if not self._settled:  # cancelled: no outcome
                self._settled = True
                self.backend.breaker.record_abandoned()


class RequestLease:
    """Everything one client request holds, and what it did (timings, choices) for headers,
    metrics and the router's outcome."""

    __slots__ = (
        "_admission", "_admitted", "_closed", "_confirm_failure", "_holds", "_metrics",
        "_releaser", "_releases", "_router", "_suspects", "cached_tokens", "canceller",
        "client_request_id", "consumer", "consumer_first_byte_s", "decision", "dialect",
        "fallback", "model_slot", "producer", "producer_s", "request_id", "retries", "route",
        "route_s", "stage", "supply", "t0", "trace",
    )  # fmt: skip

    def __init__(
        self,
        *,
        request_id: RequestId,
        client_request_id: str | None,
        route: str,
        admission: Admission,
        router: Router,
        releaser: SupplyReleaser,
        metrics: ProxyMetrics,
        confirm_failure: Callable[[Backend], None],
    ) -> None:
        self.request_id = request_id
        self.client_request_id = client_request_id
        self.route = route
        self.t0 = time.perf_counter()
        self._admission = admission
        self._router = router
        self._releaser = releaser
        self._metrics = metrics
        self._confirm_failure = confirm_failure
        self._admitted = False
        self._closed = False
        self._holds: list[BackendHold] = []
        self._suspects: list[Backend] = []
        self._releases = 0
        self.model_slot: ModelSlot | None = None
        """Its place in its model's admission (per-model limits and metrics)."""
        self.supply: Supply | None = None
        """The supply the consumer leg was sent to fetch: released at close unless the request
        succeeded."""
        self.canceller: RequestCanceller | None = None
        self.decision: RouteDecision[Backend] | None = None
        self.dialect = "none"
        self.producer: str | None = None
        self.consumer: str | None = None
        self.cached_tokens: int | None = None
        self.retries = 0
        self.fallback = False
        self.route_s = 0.0
        self.producer_s = 0.0
        self.consumer_first_byte_s = 0.0
        self.stage = "read"
        """Where the request is: read, queue, route, producer, consumer, stream."""
        self.trace: RequestTrace | None = None
        """The request's spans when tracing is on (:mod:`pdproxy.request.trace`)."""

    @property
    def closed(self) -> bool:
        return self._closed

    # -- taking

    def admit_now(self) -> bool:
        """Take a free admission slot if one is free now, without queueing."""
        self._admitted = self._admission.try_acquire()
        return self._admitted

    async def admit(self) -> None:
        """Wait in the queue for a slot (raises :class:`~pdproxy.errors.Overloaded`)."""
        self.stage = "queue"
        await self._admission.acquire()
        self._admitted = True

    def hold(self, backend: Backend) -> BackendHold:
        hold = BackendHold(backend, self)
        self._holds.append(hold)
        return hold

    def suspect(self, backend: Backend, reason: str) -> None:
        self._suspects.append(backend)
        self._metrics.upstream_failure(backend.name, reason)

    def disconnected(self) -> None:
        """The client left; counted by the stage it left in."""
        self._metrics.disconnect_aborts.labels(stage=self.stage).inc()

    def drop_supply(self, supply: Supply) -> None:
        """A producer attempt that failed or was abandoned: release its supply now."""
        self._release_supply(supply)

    # -- giving back

    async def close(self, ok: bool, status: int) -> None:
        """Give everything back; later calls do nothing. ``ok``: the client got a whole
        successful answer."""
        if self._closed:
            return
        self._closed = True
        for hold in self._holds:
            if hold.open:
                hold.release()
        if self.canceller is not None:
            self.canceller.close()
        if self.supply is not None and not ok:
            self._release_supply(self.supply)
        for backend in self._suspects:
            if ok:
                backend.breaker.record_failure()
            else:
                self._confirm_failure(backend)
        if self._admitted:
            self._admitted = False
            self._admission.release()
        if self.model_slot is not None:
            self.model_slot.release(status)
        self._metrics.count_request(self.route, status, self.dialect)
        if self.decision is not None:
            outcome = RequestOutcome(
                producer=self.producer, consumer=self.consumer, ok=ok,
                cached_tokens=self.cached_tokens,
            )  # fmt: skip
            try:
                await self._router.finished(self.decision, outcome)
            except Exception:
                log.exception("request %s: router.finished failed", self.request_id)
        if self.trace is not None:  # last: everything above is given back whatever it does
            try:
                self.trace.end(self, ok, status)
            except Exception:
                log.exception("request %s: ending its trace failed", self.request_id)

    def _release_supply(self, supply: Supply) -> None:
        self._releaser.release(supply, leg_request_id(self.request_id, "release", self._releases))
        self._releases += 1

    def observe_leg(self, leg: str, backend: str, seconds: float) -> None:
        self._metrics.observe_leg(leg, backend, seconds)

    def client_headers(self, server_timing: bool) -> dict[str, str]:
        """Headers every answer to the client carries: its own request id echoed (the proxy's
        when it sent none or an unusable one), timings, retry and fallback markers."""
        headers = {REQUEST_ID_HEADER: self.client_request_id or self.request_id}
        if server_timing:
            headers["server-timing"] = self.server_timing()
        if self.retries:
            headers[RETRIES_HEADER] = str(self.retries)
        if self.fallback:
            headers[FALLBACK_HEADER] = "consumer-only"
        return headers

    def server_timing(self) -> str:
        parts = [f"route;dur={self.route_s * 1000:.3f}"]
        if self.producer_s:
            parts.append(f"producer;dur={self.producer_s * 1000:.3f}")
        if self.consumer_first_byte_s:
            parts.append(f"consumer_fb;dur={self.consumer_first_byte_s * 1000:.3f}")
        return ", ".join(parts)


class LeasedResponse(Response):
    """What the request path hands the server: a plain response or a relayed stream, with the
    request's lease closed once it has been sent, the stream ended, or the client left."""

    def __init__(self, lease: RequestLease, body: Response | Relay) -> None:
        # No super().__init__: the status and headers are the wrapped body's.
        self.status_code = body.status_code
        self.background = None
        self.raw_headers = list(body.raw_headers)
        self._lease = lease
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ok = False
        try:
            body = self._body
            if isinstance(body, Relay):
                self._lease.stage = "stream"
                ok = await body.run(send, self._lease)
            else:
                body.raw_headers = self.raw_headers
                await body(scope, receive, send)
                ok = 200 <= self.status_code < 300
        finally:
            await self._lease.close(ok, self.status_code)
