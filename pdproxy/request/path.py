"""The request path: one client request → producer leg (maybe) → consumer leg → client.

In order (:meth:`RequestPath._serve`): the client key (401), an admission slot (429 at once when the
queue is full; a client leaving while queued is heard, :mod:`pdproxy.front.admission`), the body
(413 past the size limit, 408 past the read deadline), the ``kv_transfer_params`` gate (400), the
tenant's ``cache_salt`` (:mod:`pdproxy.front.tenants`), the model (404 when no backend serves it;
:mod:`pdproxy.fleet.models`) and its per-model admission slot (429), the candidates (filtered by
model, role, dialect and routability before the router ranks them), the route, the producer phase
(:mod:`pdproxy.request.producer`; consumer-only fallback when it fails), the consumer phase
(:mod:`pdproxy.request.consumer`; when every consumer leg carrying the producer's KV failed with a
server error, one more leg without it on the consumer that answered).

Two objects go down the line. The :class:`~pdproxy.request.lease.RequestLease` holds what the
request takes and gives it back once, when the :class:`LeasedResponse` this path returns has
been sent, its stream has ended or its client has left. The
:class:`~pdproxy.request.record.RequestRecord` holds what the request did; this module writes
it from what each phase returns, and the answer's headers, the metrics, the trace and the
router's outcome are read from it at the end.

Upstream failures reach the client as generic OpenAI-shaped errors: backend names and
addresses stay in the logs and in ``pdproxy_upstream_failures``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
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
from pdproxy.front.direct import DirectExchange
from pdproxy.front.intake import (
    ROUTE_EXPLAIN,
    ClientBody,
    ClientKeys,
    Endpoint,
    check_declared_size,
    check_kv_params,
    decode_body,
    latency_ask,
    read_body,
    wants_route_explain,
)
from pdproxy.front.request import DISCONNECT_HOOK, ClientRequest
from pdproxy.front.responses import client_error_response, error_response, redact
from pdproxy.front.tenants import CacheSalts
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.observe.trace_context import trace_headers
from pdproxy.request.consumer import ConsumerPhase, ConsumerResult
from pdproxy.request.failover import StreamFailover
from pdproxy.request.lease import LeasedResponse, RequestLease
from pdproxy.request.legs import consumer_body, kv_peer_of, with_kv_source
from pdproxy.request.producer import ProducerPhase, ProducerResult
from pdproxy.request.record import RequestRecord, client_request_id, new_request_id
from pdproxy.request.relay import Relay
from pdproxy.request.release import SupplyReleaser
from pdproxy.request.retry import RetryPolicy
from pdproxy.routing.base import PullSource, RouteDecision, Router, RouteRequest
from pdproxy.routing.candidates import candidates
from pdproxy.routing.explain_header import route_explain_value
from pdproxy.routing.session import session_of
from pdproxy.settings import Dialect, ProxySettings
from pdproxy.upstream.client import Upstream

if TYPE_CHECKING:
    from pdproxy.request.trace import RequestTracer

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499

_Refusal = ClientRequestError | NoBackendAvailable | LegRefused | LegFailed
_REFUSALS = (ClientRequestError, NoBackendAvailable, LegRefused, LegFailed)
"""What ends a request with an answer of the proxy's own (:meth:`RequestPath._refusal`)."""


class RequestPath:
    """One per app. :meth:`handle` is called once per client request, on the event loop, by
    the app's hot routes; everything it starts ends before the returned response is done."""

    def __init__(
        self,
        *,
        settings: ProxySettings,
        keys: ClientKeys,
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
        self._tracer = tracer
        self._keys = keys
        self._registry = registry
        self._router = router
        self._metrics = metrics
        self._admission = admission
        self._health = health
        self._catalog = catalog
        self._model_admission = model_admission
        self._max_body = settings.admission.max_body_bytes
        self._body_timeout_s = settings.admission.body_read_timeout_s
        self._fallback = settings.retries.fallback_to_consumer
        self._server_timing = settings.server_timing
        self._debug_headers = settings.debug_headers
        secret = settings.tenants.with_secret().salt_secret
        assert secret is not None
        self._salts = CacheSalts(secret.get_secret_value().encode())
        self._releaser = SupplyReleaser(upstream, metrics)
        retry = RetryPolicy(settings.retries, metrics)
        self._producers = ProducerPhase(upstream, retry, metrics)
        self._consumers = ConsumerPhase(
            upstream, retry, metrics, idle_s=settings.timeouts.consumer_idle_s
        )
        self._failover = StreamFailover(
            settings.failover, upstream, metrics, first_attempts=retry.consumer_attempts
        )

    # ------------------------------------------------------------------ entry point

    async def answer(self, request: ClientRequest, endpoint: Endpoint) -> Response:
        """:meth:`handle`, with a bug answered 500 (the hot routes' entry, ASGI's and
        ``pdproxy serve``'s direct one alike)."""
        try:
            return await self.handle(request, endpoint)
        except Exception:
            log.exception("unhandled error on %s", endpoint.path)
            return error_response(500, "internal proxy error", code="internal_error")

    async def handle(self, request: ClientRequest, endpoint: Endpoint) -> Response:
        headers = request.headers
        record = RequestRecord(
            new_request_id(), client_request_id(headers), endpoint, time.perf_counter()
        )
        tracer = self._tracer
        lease = RequestLease(
            record.request_id,
            admission=self._admission,
            router=self._router,
            releaser=self._releaser,
            metrics=self._metrics,
            confirm_failure=self._health.confirm,
            trace=None if tracer is None else tracer.start(record.request_id, endpoint, headers),
        )
        try:
            try:
                answer = await self._serve(request, headers, lease, record)
            except asyncio.CancelledError as exc:
                canceller = lease.canceller
                if canceller is None or not canceller.owns(exc):
                    raise
                log.info("request %s: client disconnected; legs cancelled", record.request_id)
                answer = self._client_left(record)
            except ClientDisconnect:
                answer = self._client_left(record)
            except _REFUSALS as exc:
                answer = self._refusal(exc, record)
        except BaseException:
            # Never sent (a bug, or the server cancelling the task): give everything back here.
            await lease.close(False, 500, record)
            raise
        decision = lease.decision
        if self._debug_headers and decision is not None and wants_route_explain(headers):
            answer.raw_headers.append(
                (ROUTE_EXPLAIN.encode(), route_explain_value(decision).encode("latin-1"))
            )
        return LeasedResponse(
            lease, record, answer, record.client_headers(self._server_timing), self._metrics
        )

    # ------------------------------------------------------------------ the line

    async def _serve(
        self, request: ClientRequest, headers: Headers, lease: RequestLease, record: RequestRecord
    ) -> Response | Relay:
        """The client's answer. What the request takes goes into ``lease``, what it did into
        ``record``; a refusal or the client leaving raises (:meth:`handle` answers those)."""
        # The client: its key, an admission slot, its body.
        caller = self._keys.authenticate(headers)
        record.hides_cached_tokens = not caller.sees_cached_tokens
        check_declared_size(headers, self._max_body)
        received = None
        if not lease.admit_now():
            record.stage = "queue"
            received = await wait_for_slot(lease.admit(), request.receive)
            record.stage = "read"
        # Under pdproxy serve's direct routes a body that has all arrived is taken as it is
        # (no receive() message, no deadline timer: nothing is left to wait for).
        raw = None
        if received is None and type(request) is DirectExchange:
            raw = request.arrived(self._max_body)
        if raw is None:
            raw = await read_body(request.receive, self._max_body, self._body_timeout_s, received)
        body = decode_body(raw)
        passthrough = check_kv_params(body.data, caller.trusted)
        # The tenant's salt, once: the router hashes the body both legs carry. A trusted caller
        # passing its own kv_transfer_params runs the other leg itself, with its own salt.
        if not passthrough:
            body = self._salts.salted(caller, body)
        lease.canceller = RequestCanceller(request.receive, request.scope.get(DISCONNECT_HOOK))
        if record.client_request_id is not None:
            log.debug("request %s: client id %s", record.request_id, record.client_request_id)

        # The model (resolved once: it picks the model's admission and the candidates), the route.
        model = self._catalog.resolve(body.data) if self._catalog is not None else None
        if model is not None and self._model_admission is not None:
            record.stage = "queue"
            lease.model_slot = await self._model_admission.acquire(model.label)
        t = time.perf_counter()
        pool = candidates(self._registry, with_producers=not passthrough, model=model)
        record.dialect = pool.dialect.value
        record.stage = "route"
        trace = lease.trace
        if trace is not None:
            trace.routing()
        ask = latency_ask(headers, caller)
        route = RouteRequest(
            record.request_id, record.endpoint, body.data, len(raw),
            session=session_of(headers, body.data, caller.key_scope),
            model=model.name if model is not None else None,
            ttft_class=ask.ttft_class, ttft_target_ms=ask.target_ms,
        )  # fmt: skip
        decision = lease.decision = await self._router.route(route, pool.producers, pool.consumers)
        if trace is not None:
            trace.routed(decision)
        # Server-Timing's ``route``: the router's own decision time when it reports one (the
        # KV router: tokenize, hash, match, score, record), else the time the call took here.
        record.route_s = decision.route_time_s or time.perf_counter() - t
        if not decision.consumers:
            raise NoBackendAvailable("the router chose no consumer")
        base = {"content-type": "application/json", **trace_headers(headers)}
        # A pull names a holder from configuration; never mixed with a client's own params.
        pull = decision.pull if pool.dialect is Dialect.P2P and not passthrough else None

        # The producer phase, when the router chose producers.
        produced: ProducerResult | None = None
        if decision.producers:
            record.stage = "producer"
            producers = decision.producers
            t = time.perf_counter()
            try:
                produced = await self._producers.run(
                    lease, record, body, producers, ranks=decision.producer_ranks,
                    dialect=pool.dialect, kv_source=pull,
                    base=base if trace is None else trace.leg("producer", producers, base),
                )  # fmt: skip
            finally:
                record.producer_s = time.perf_counter() - t
            if produced is not None:
                record.producer = produced.producer
                record.producer_cached_tokens = produced.cached_tokens
                record.kv_peer = kv_peer_of(produced.kv_params)
            if trace is not None:
                trace.producer_done(record.producer, record.retries)
            if produced is None:
                if not self._fallback:
                    raise LegFailed("producers", "every producer attempt failed")
                self._fell_back(record)
                log.warning(
                    "request %s: producers failed; consumer serves alone", record.request_id
                )

        # The consumer phase: its answer, and once more without the producer's KV if that broke it.
        record.stage = "consumer"
        if pull is not None and not decision.producers:
            done = await self._pulling_consumer(lease, record, body, decision, pull, base=base)
        else:
            consumers = decision.consumers
            ranks = decision.consumer_ranks
            stream = body.data.get("stream") is True
            plan = self._failover.plan(record.endpoint, body, stream)
            kv_params = produced.kv_params if produced is not None else None
            leg = consumer_body(body, kv_params) if plan is None else plan.first_leg(kv_params)
            alone: Backend | None = None
            try:
                done = await self._consumers.run(
                    lease, record, leg, consumers, ranks=ranks, stream=stream, plan=plan,
                    base=base if trace is None else trace.leg("consumer", consumers, base),
                )  # fmt: skip
            except LegFailed as exc:
                alone = self._recompute_on(exc, produced, consumers)
                if alone is None:
                    raise
            if alone is not None:
                # The consumer could not use the producer's KV: it prefills the prompt itself.
                if produced is not None:
                    lease.drop_supply(produced.supply)  # nobody will fetch it now
                self._fell_back(record)
                log.warning(
                    "request %s: %s failed the leg carrying the producer's KV; it prefills alone",
                    record.request_id, alone.name,
                )  # fmt: skip
                leg = consumer_body(body, None) if plan is None else plan.first_leg(None)
                done = await self._consumers.run(
                    lease, record, leg, [alone], ranks=ranks, stream=stream, plan=plan,
                    base=base if trace is None else trace.leg("consumer", [alone], base),
                    first_attempt=self._consumers.most_legs(consumers),
                )  # fmt: skip
        record.consumer = done.consumer
        record.consumer_first_byte_s = done.first_byte_s
        record.cached_tokens = done.cached_tokens
        return done.answer

    def _fell_back(self, record: RequestRecord) -> None:
        record.fallback = True
        self._metrics.fallbacks.inc()

    def _recompute_on(
        self, exc: LegFailed, produced: ProducerResult | None, consumers: Sequence[Backend]
    ) -> Backend | None:
        """The consumer that should prefill alone after every consumer leg carrying the
        producer's KV failed, or None. Only one that *answered* a server error: vLLM fails a
        request whose KV load failed (a NIXL handshake that timed out, a producer gone or its
        blocks expired) with 500 under its default ``kv_load_failure_policy=fail``, and the
        producer's KV cannot be had again, so one more leg without it is the only way to serve
        the request. Not after a timeout, a connection failure, 503 or 429 (that consumer is
        gone or busy), nor when ``retries.fallback_to_consumer`` is off."""
        status = exc.status
        if produced is None or not self._fallback or status is None:
            return None
        if not 500 <= status < 600 or status == 503:
            return None
        return next((c for c in consumers if c.name == exc.backend), None)

    async def _pulling_consumer(
        self,
        lease: RequestLease,
        record: RequestRecord,
        body: ClientBody,
        decision: RouteDecision[Backend],
        pull: PullSource,
        *,
        base: dict[str, str],
    ) -> ConsumerResult:
        """The consumer alone pulls the prefix from ``pull.holder``; failover goes to the other
        consumers with the same pull, and last to the holder itself without one."""
        targets = [c for c in decision.consumers if c.name != pull.holder]
        holder = [c for c in decision.consumers if c.name == pull.holder]
        ranks = decision.consumer_ranks
        trace = lease.trace
        stream = body.data.get("stream") is True
        log.debug(
            "request %s: %s pulls %d blocks from %s",
            record.request_id, targets[0].name if targets else "-", pull.blocks, pull.holder,
        )  # fmt: skip
        try:
            return await self._consumers.run(
                lease, record, consumer_body(body, with_kv_source(None, pull)), targets,
                ranks=ranks, stream=stream,
                base=base if trace is None else trace.leg("consumer", targets, base),
            )  # fmt: skip
        except (LegFailed, NoBackendAvailable):
            if not holder:
                raise
        return await self._consumers.run(
            lease, record, body.raw, holder, ranks=ranks, stream=stream,
            base=base if trace is None else trace.leg("consumer", holder, base),
        )  # fmt: skip

    # ------------------------------------------------------------------ answers of our own

    def _client_left(self, record: RequestRecord) -> Response:
        self._metrics.disconnect_aborts.labels(stage=record.stage).inc()
        return Response(status_code=CLIENT_CLOSED_STATUS)

    def _refusal(self, exc: _Refusal, record: RequestRecord) -> Response:
        if isinstance(exc, ClientRequestError):
            if isinstance(exc, BodyReadTimeout):
                self._metrics.body_read_timeouts.inc()
                log.info("request %s: body not received in time", record.request_id)
            return client_error_response(exc)
        if isinstance(exc, LegRefused):
            if record.stage == "consumer":
                record.consumer = exc.backend  # the router hears which consumer refused
            return Response(
                redact(exc.body, self._internal_names(record)),
                status_code=exc.status,
                media_type=exc.content_type or "application/json",
            )
        if isinstance(exc, NoBackendAvailable):
            log.warning("request %s: %s", record.request_id, exc)
            return error_response(
                503, "no backend is available; retry later", code="no_backend_available",
                headers={"retry-after": "1"},
            )  # fmt: skip
        log.warning("request %s: upstream failed: %s", record.request_id, exc)
        return error_response(
            504 if exc.timed_out else 502,
            "upstream timed out" if exc.timed_out else "upstream failed",
            error_type="upstream_error",
            code="upstream_timeout" if exc.timed_out else "upstream_failed",
        )

    def _internal_names(self, record: RequestRecord) -> list[str]:
        """What an engine's refusal may quote that the client must not see: every backend's
        ``host:port`` and KV address, the KV peer this request was sent to, and those hosts
        alone where they are addresses or dotted names (a bare short name such as ``d`` would
        also match ordinary words of the message)."""
        pairs = [record.kv_peer or ""]
        for backend in self._registry.all():
            pairs.append(urlsplit(backend.url).netloc)
            if backend.kv_address is not None:
                host, port = backend.kv_address
                pairs.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        hosts = [p.rsplit(":", 1)[0].strip("[]") for p in pairs if ":" in p]
        return pairs + [h for h in hosts if "." in h or ":" in h]

    async def drain_background(self, timeout_s: float) -> None:
        """Wait (bounded) for pending P2P releases; used at shutdown."""
        await self._releaser.drain(timeout_s)
