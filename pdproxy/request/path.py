"""The request path: one client request → producer leg (maybe) → consumer leg → client.

In order: the client key (401), an admission slot (429 at once when the queue is full; a
client leaving while queued is heard, :mod:`pdproxy.front.admission`), the body (413 past the size
limit, 408 past the read deadline), the ``kv_transfer_params`` gate
(400), the model (404 when no backend serves it; :mod:`pdproxy.fleet.models`) and its
per-model admission slot (429), the candidates (filtered by model, role and dialect before the
router ranks them), the
producer phase (:mod:`pdproxy.request.producer`; consumer-only fallback when it fails), the
consumer phase (:mod:`pdproxy.request.consumer`; when every consumer leg carrying the producer's
KV failed with a server error, one more leg without it on the consumer that answered).
Everything the request takes belongs to its :class:`~pdproxy.request.lease.RequestLease`, which the
returned :class:`~pdproxy.request.lease.LeasedResponse` closes once the answer is sent, the stream
ends or the client leaves.

Upstream failures reach the client as generic OpenAI-shaped errors: backend names and
addresses stay in the logs and in ``pdproxy_upstream_failures``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdproxy.errors import (
    BodyReadTimeout,
    ClientRequestError,
    LegFailed,
    LegRefused,
    NoBackendAvailable,
)
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.health import HealthChecker
from pdproxy.fleet.models import ModelCatalog
from pdproxy.front.admission import Admission, ModelAdmission, wait_for_slot
from pdproxy.front.cancel import RequestCanceller
from pdproxy.front.intake import (
    ROUTE_EXPLAIN,
    ClientBody,
    ClientKeys,
    check_declared_size,
    check_kv_params,
    decode_body,
    read_body,
    wants_route_explain,
)
from pdproxy.front.protocol import DISCONNECT_HOOK
from pdproxy.front.responses import client_error_response, error_response
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.observe.trace_context import trace_headers
from pdproxy.request.consumer import ConsumerPhase
from pdproxy.request.failover import StreamFailover
from pdproxy.request.ids import client_request_id, new_request_id
from pdproxy.request.lease import LeasedResponse, RequestLease
from pdproxy.request.legs import consumer_body, with_kv_source
from pdproxy.request.producer import ProducerPhase
from pdproxy.request.relay import Relay
from pdproxy.request.release import SupplyReleaser
from pdproxy.request.retry import RetryPolicy
from pdproxy.routing.base import PullSource, Router, RouteRequest
from pdproxy.routing.candidates import candidates
from pdproxy.routing.explain_header import route_explain_value
from pdproxy.routing.session import session_of
from pdproxy.settings import Dialect, ProxySettings
from pdproxy.upstream.client import Upstream

if TYPE_CHECKING:
    from pdproxy.request.trace import RequestTracer

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499


class RequestPath:
    def __init__(
        self,
        *,
        settings: ProxySettings,
        registry: BackendRegistry,
        router: Router,
        upstream: Upstream,
        metrics: ProxyMetrics,
        admission: Admission,
        health: HealthChecker,
        tracer: RequestTracer | None = None,
        catalog: ModelCatalog | None = None,
        model_admission: ModelAdmission | None = None,
    ) -> None:
        self._settings = settings
        self._tracer = tracer
        self._registry = registry
        self._router = router
        self._metrics = metrics
        self._admission = admission
        self._health = health
        self._catalog = catalog
        self._model_admission = model_admission
        self._keys = ClientKeys(settings.api_keys)
        self._max_body = settings.admission.max_body_bytes
        self._body_timeout_s = settings.admission.body_read_timeout_s
        self._fallback = settings.retries.fallback_to_consumer
        self._server_timing = settings.server_timing
        self._releaser = SupplyReleaser(upstream, metrics)
        retry = RetryPolicy(settings.retries, metrics)
        self._producers = ProducerPhase(upstream, retry, metrics)
        self._consumers = ConsumerPhase(
            upstream, retry, metrics,
            idle_s=settings.timeouts.consumer_idle_s, server_timing=settings.server_timing,
        )  # fmt: skip
        self._debug_headers = settings.debug_headers
        self._failover = StreamFailover(
            settings.failover, upstream, metrics, first_attempts=retry.consumer_attempts
        )

    # ------------------------------------------------------------------ entry point

    async def handle(self, request: Request, route: str) -> Response:
        lease = RequestLease(
            request_id=new_request_id(),
            client_request_id=client_request_id(request.headers),
            route=route,
            admission=self._admission,
            router=self._router,
            releaser=self._releaser,
            metrics=self._metrics,
            confirm_failure=self._health.confirm,
        )
        if self._tracer is not None:
            lease.trace = self._tracer.start(lease.request_id, route, request.headers)
        try:
            body = await self._respond(request, lease)
        except BaseException:
            # Never sent (a bug, or the server cancelling the task): give everything back here.
            await lease.close(False, 500)
            raise
        decision = lease.decision
        if self._debug_headers and decision is not None and wants_route_explain(request.headers):
            body.raw_headers.append(
                (ROUTE_EXPLAIN.encode(), route_explain_value(decision).encode("latin-1"))
            )
        return LeasedResponse(lease, body)

    async def _respond(self, request: Request, lease: RequestLease) -> Response | Relay:
        headers = request.headers
        try:
            trusted = self._keys.authenticate(headers)
            check_declared_size(request, self._max_body)
            received = (
                None if lease.admit_now() else await wait_for_slot(lease.admit(), request.receive)
            )
            lease.stage = "read"
            raw = await read_body(request.receive, self._max_body, self._body_timeout_s, received)
            body = decode_body(raw)
            passthrough = check_kv_params(body.data, trusted)
        except BodyReadTimeout as exc:
            self._metrics.body_read_timeouts.inc()
            log.info("request %s: body not received in time", lease.request_id)
            return self._client_error(exc, lease)
        except ClientRequestError as exc:
            return self._client_error(exc, lease)
        except ClientDisconnect:
            lease.disconnected()
            return Response(status_code=CLIENT_CLOSED_STATUS)

        canceller = RequestCanceller(request.receive, request.scope.get(DISCONNECT_HOOK))
        lease.canceller = canceller
        if lease.client_request_id is not None:
            log.debug("request %s: client id %s", lease.request_id, lease.client_request_id)
        try:
            return await self._serve(lease, body, headers, passthrough)
        except asyncio.CancelledError as exc:
            if not canceller.owns(exc):
                raise
            lease.disconnected()
            log.info("request %s: client disconnected; legs cancelled", lease.request_id)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except ClientRequestError as exc:
            return self._client_error(exc, lease)
        except NoBackendAvailable as exc:
            log.warning("request %s: %s", lease.request_id, exc)
            return error_response(
                503, "no backend is available; retry later", code="no_backend_available",
                headers={**lease.client_headers(self._server_timing), "retry-after": "1"},
            )  # fmt: skip
        except LegRefused as exc:
            return Response(
                exc.body,
                status_code=exc.status,
                headers=lease.client_headers(self._server_timing),
                media_type=exc.content_type or "application/json",
            )
        except LegFailed as exc:
            log.warning("request %s: upstream failed: %s", lease.request_id, exc)
            status = 504 if exc.timed_out else 502
            return error_response(
                status,
                "upstream timed out" if exc.timed_out else "upstream failed",
                error_type="upstream_error",
                code="upstream_timeout" if exc.timed_out else "upstream_failed",
                headers=lease.client_headers(self._server_timing),
            )

    def _client_error(self, exc: ClientRequestError, lease: RequestLease) -> Response:
        return client_error_response(exc, lease.client_headers(self._server_timing))

    # ------------------------------------------------------------------ the legs

    async def _serve(
        self, lease: RequestLease, body: ClientBody, headers: Headers, passthrough: bool
    ) -> Response | Relay:
        model = self._catalog.resolve(body.data) if self._catalog is not None else None
        if model is not None and self._model_admission is not None:
            lease.stage = "queue"
            lease.model_slot = await self._model_admission.acquire(model.label)
        t = time.perf_counter()
        pool = candidates(self._registry, with_producers=not passthrough, model=model)
        lease.dialect = pool.dialect.value
        lease.stage = "route"
        trace = lease.trace
        if trace is not None:
            trace.routing()
        request = RouteRequest(
            lease.request_id, lease.route, body.data, len(body.raw),
            session=session_of(headers, body.data),
        )  # fmt: skip
        decision = await self._router.route(request, pool.producers, pool.consumers)
        lease.decision = decision
        if trace is not None:
            trace.routed(decision)
        # Server-Timing's ``route``: the router's own decision time when it reports one (the
        # KV router: tokenize, hash, match, score, record), else the time the call took here.
        lease.route_s = decision.route_time_s or time.perf_counter() - t
        if not decision.consumers:
            raise NoBackendAvailable("the router chose no consumer")
        base = {"content-type": "application/json", **trace_headers(headers)}
        # A pull names a holder from configuration; never mixed with a client's own params.
        pull = decision.pull if pool.dialect is Dialect.P2P and not passthrough else None

        kv_params = None
        if decision.producers:
            lease.stage = "producer"
            producers = list(decision.producers)
            kv_params = await self._producers.run(
                lease, body, producers, pool.dialect,
                base if trace is None else trace.leg("producer", producers, base),
                kv_source=pull,
            )  # fmt: skip
            if trace is not None:
                trace.producer_done(lease, kv_params is not None)
            if kv_params is None:
                if not self._fallback:
                    raise LegFailed("producers", "every producer attempt failed")
                lease.fallback = True
                self._metrics.fallbacks.inc()
                log.warning("request %s: producers failed; consumer serves alone", lease.request_id)
        lease.stage = "consumer"
        consumers = list(decision.consumers)
        if pull is not None and not decision.producers:
            return await self._pulling_consumer(lease, body, consumers, pull, base)
        stream = body.data.get("stream") is True
        plan = self._failover.plan(lease.route, body, stream)
        try:
            return await self._consumers.run(
                lease,
                consumer_body(body, kv_params) if plan is None else plan.first_leg(kv_params),
                consumers,
                base if trace is None else trace.leg("consumer", consumers, base),
                stream=stream,
                plan=plan,
            )
        except LegFailed as exc:
            alone = self._recompute_on(exc, kv_params, consumers)
            if alone is None:
                raise
        # The consumer could not use the producer's KV: it prefills the prompt itself.
        supply, lease.supply = lease.supply, None
        if supply is not None:
            lease.drop_supply(supply)  # nobody will fetch it now
        lease.fallback = True
        self._metrics.fallbacks.inc()
        log.warning(
            "request %s: %s failed the leg carrying the producer's KV; it prefills alone",
            lease.request_id, alone.name,
        )  # fmt: skip
        return await self._consumers.run(
            lease,
            consumer_body(body, None) if plan is None else plan.first_leg(None),
            [alone],
            base if trace is None else trace.leg("consumer", [alone], base),
            stream=stream,
            plan=plan,
            first_attempt=self._consumers.most_legs(consumers),
        )

    def _recompute_on(
        self, exc: LegFailed, kv_params: dict[str, Any] | None, consumers: list[Backend]
    ) -> Backend | None:
        """The consumer that should prefill alone after every consumer leg carrying the
        producer's KV failed, or None. Only one that *answered* a server error: vLLM fails a
        request whose KV load failed (a NIXL handshake that timed out, a producer gone or its
        blocks expired) with 500 under its default ``kv_load_failure_policy=fail``, and the
        producer's KV cannot be had again, so one more leg without it is the only way to serve
        the request. Not after a timeout, a connection failure, 503 or 429 (that consumer is
        gone or busy), nor when ``retries.fallback_to_consumer`` is off."""
        status = exc.status
        if kv_params is None or not self._fallback or status is None:
            return None
        if not 500 <= status < 600 or status == 503:
            return None
        return next((c for c in consumers if c.name == exc.backend), None)

    async def _pulling_consumer(
        self,
        lease: RequestLease,
        body: ClientBody,
        consumers: list[Backend],
        pull: PullSource,
        base: dict[str, str],
    ) -> Response | Relay:
        """The consumer alone pulls the prefix from ``pull.holder``; failover goes to the other
        consumers with the same pull, and last to the holder itself without one."""
        targets = [c for c in consumers if c.name != pull.holder]
        holder = [c for c in consumers if c.name == pull.holder]
        trace = lease.trace
        log.debug(
            "request %s: %s pulls %d blocks from %s",
            lease.request_id, targets[0].name if targets else "-", pull.blocks, pull.holder,
        )  # fmt: skip
        try:
            return await self._consumers.run(
                lease, consumer_body(body, with_kv_source(None, pull)), targets,
                base if trace is None else trace.leg("consumer", targets, base),
                stream=body.data.get("stream") is True,
            )  # fmt: skip
        except (LegFailed, NoBackendAvailable):
            if not holder:
                raise
        return await self._consumers.run(
            lease, body.raw, holder,
            base if trace is None else trace.leg("consumer", holder, base),
            stream=body.data.get("stream") is True,
        )  # fmt: skip

    async def drain_background(self, timeout_s: float) -> None:
        """Wait (bounded) for pending P2P releases; used at shutdown."""
        await self._releaser.drain(timeout_s)
