"""One owner per request: :class:`RequestLease`, closed exactly once on every path.

A request takes things that must be given back: its admission slot and its model's, one
in-flight count per backend leg (:class:`BackendHold`), the P2P supplies producers may hold for
it, the router's ticket (``router.finished``), its disconnect watcher and its trace. The lease
holds these and nothing else, and :meth:`RequestLease.close` gives every one back. The request
path hands the server a :class:`LeasedResponse`, which closes it once the answer is sent, the
stream ends or the client leaves; nothing else releases anything. What the request *did* (who
served, timings, retries) is not the lease's: the path keeps it in a
:class:`~pdproxy.request.record.RequestRecord` and hands it to :meth:`RequestLease.close`,
which reports it to the router, the metrics and the trace.

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
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdproxy.errors import KvAddressMismatch, LegFailed
from pdproxy.fleet.backends import Backend
from pdproxy.front.admission import Admission, ModelSlot
from pdproxy.front.cancel import RequestCanceller
from pdproxy.front.tenants import CachedTokensHidden
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.record import RequestId, RequestRecord, leg_request_id
from pdproxy.request.relay import Relay
from pdproxy.request.release import Supply, SupplyReleaser
from pdproxy.routing.base import RequestOutcome, RouteDecision, Router

if TYPE_CHECKING:
    from pdproxy.request.trace import RequestTrace

log = logging.getLogger(__name__)


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
    """Everything one client request holds until it ends. Taken as the request goes (the path
    and its phases call :meth:`admit_now`/:meth:`admit` and :meth:`hold`, and set
    :attr:`model_slot`, :attr:`decision`, :attr:`canceller`, :attr:`supply`), given back by
    :meth:`close`. Runs on the event loop only."""

    __slots__ = (
        "_admission", "_admitted", "_closed", "_confirm_failure", "_holds", "_metrics",
        "_releaser", "_releases", "_router", "_suspects", "canceller", "decision", "model_slot",
        "request_id", "supply", "trace",
    )  # fmt: skip

    def __init__(
        self,
        request_id: RequestId,
        *,
        admission: Admission,
        router: Router,
        releaser: SupplyReleaser,
        metrics: ProxyMetrics,
        confirm_failure: Callable[[Backend], None],
        trace: RequestTrace | None = None,
    ) -> None:
        self.request_id = request_id
        """Names the releases this lease sends (``<id>-r0``...)."""
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
        """Its place in its model's admission: released with the status the client got."""
        self.decision: RouteDecision[Backend] | None = None
        """The router's ticket: ``router.finished`` is owed for it, once."""
        self.canceller: RequestCanceller | None = None
        """The disconnect watcher (from when the body has been read): closed at the end."""
        self.trace = trace
        """The request's spans when tracing is on: ended last."""
        self.supply: Supply | None = None
        """The supply the consumer leg is sent to fetch: released at close unless the request
        succeeded (then the consumer fetched it and the producer let it go)."""

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
        await self._admission.acquire()
        self._admitted = True

    def hold(self, backend: Backend) -> BackendHold:
        hold = BackendHold(backend, self)
        self._holds.append(hold)
        return hold

    def suspect(self, backend: Backend, reason: str) -> None:
        """``backend`` failed a leg: whose fault it was is settled at :meth:`close`."""
        self._suspects.append(backend)
        self._metrics.upstream_failure(backend.name, reason)

    def drop_supply(self, supply: Supply) -> None:
        """Release ``supply`` now: a producer attempt that failed or was abandoned, or the
        kept one when no consumer will fetch it."""
        if supply is self.supply:
            self.supply = None
        self._release_supply(supply)

    # -- giving back

    async def close(self, ok: bool, status: int, record: RequestRecord) -> None:
        """Give everything back and report ``record`` (to the metrics, the router, the trace);
        later calls do nothing. ``ok``: the client got a whole successful answer; ``status``:
        the one it got."""
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
        self._metrics.count_request(record.endpoint, status, record.dialect)
        if self.decision is not None:
            outcome = RequestOutcome(
                producer=record.producer, consumer=record.consumer, ok=ok,
                cached_tokens=record.cached_tokens,
                producer_cached_tokens=record.producer_cached_tokens,
                producer_s=record.producer_s,
                consumer_first_byte_s=record.consumer_first_byte_s,
            )  # fmt: skip
            try:
                await self._router.finished(self.decision, outcome)
            except Exception:
                log.exception("request %s: router.finished failed", self.request_id)
        if self.trace is not None:  # last: everything above is given back whatever it does
            try:
                self.trace.end(record, ok, status)
            except Exception:
                log.exception("request %s: ending its trace failed", self.request_id)

    def _release_supply(self, supply: Supply) -> None:
        self._releaser.release(supply, leg_request_id(self.request_id, "release", self._releases))
        self._releases += 1


class LeasedResponse(Response):
    """What the request path hands the server: a plain response or a relayed stream, with the
    request's own headers in front, and its lease closed once it has been sent, the stream
    ended, or the client left."""

    def __init__(
        self,
        lease: RequestLease,
        record: RequestRecord,
        answer: Response | Relay,
        headers: list[tuple[bytes, bytes]],
        metrics: ProxyMetrics,
    ) -> None:
        # No super().__init__: the status and the rest of the headers are the answer's.
        self.status_code = answer.status_code
        self.background = None
        headers += answer.raw_headers
        self.raw_headers = headers
        self._lease = lease
        self._record = record
        self._answer = answer
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ok = False
        record = self._record
        try:
            answer = self._answer
            answer.raw_headers = self.raw_headers
            if isinstance(answer, Relay):
                record.stage = "stream"
                end = await answer.run(
                    CachedTokensHidden(send) if record.hides_cached_tokens else send
                )
                ok = end.ok
                record.consumer = end.consumer
                record.cached_tokens = end.cached_tokens
                if end.client_left:
                    self._metrics.disconnect_aborts.labels(stage=record.stage).inc()
            else:
                await answer(scope, receive, send)
                ok = 200 <= self.status_code < 300
        finally:
            await self._lease.close(ok, self.status_code, record)
