"""The request path: one client request → producer leg (maybe) → consumer leg → client.

Producer leg failures (connect, timeout, 5xx, 429) walk down the router's ranked producers
with jittered backoff, bounded in count and time; then the consumer serves alone (fallback).
Consumer failures before the first byte walk down the ranked consumers. The client leaving
cancels whatever leg is in flight; in the P2P dialect the producer is told to release the
supply. ``router.finished`` is called exactly once per decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pdproxy.admission import Admission
from pdproxy.backends import Backend, BackendRegistry
from pdproxy.body import ClientBody, decode_body
from pdproxy.cancel import CLIENT_DISCONNECT, RequestCanceller
from pdproxy.errors import (
    ClientRequestError,
    LegFailed,
    LegRefused,
    NoBackendAvailable,
)
from pdproxy.exchange import Exchange, find_cached_tokens, report_to_router
from pdproxy.headers import (
    REQUEST_ID,
    ROUTE_EXPLAIN,
    request_id_for,
    route_explain_value,
    upstream_base_headers,
    wants_route_explain,
    with_backend_auth,
)
from pdproxy.http_errors import client_error_response, error_response
from pdproxy.intake import ClientKeys, read_body
from pdproxy.legs import (
    consumer_body,
)
from pdproxy.metrics import ProxyMetrics
from pdproxy.producer_phase import ROUTE_PATHS, ProducerPhase
from pdproxy.relay import RelayResponse
from pdproxy.release import Supply, SupplyReleaser
from pdproxy.routing.base import BackendView, Router, RouteRequest
from pdproxy.settings import Dialect, ProxySettings
from pdproxy.upstream import Upstream

log = logging.getLogger(__name__)

FALLBACK_HEADER = "x-pdproxy-fallback"
RETRIES_HEADER = "x-pdproxy-retries"
CLIENT_CLOSED_STATUS = 499
_RELAYED_HEADERS = ("content-type", "cache-control")


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
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._router = router
        self._upstream = upstream
        self._metrics = metrics
        self._admission = admission
        self._keys = ClientKeys(settings.api_keys)
        self._max_body = settings.admission.max_body_bytes
        self._retries = settings.retries
        self._idle_s = settings.timeouts.consumer_idle_s
        self._releaser = SupplyReleaser(upstream, metrics)
        self._producers = ProducerPhase(upstream, self._releaser, metrics, settings.retries)
        self._debug_headers = settings.debug_headers

    # ------------------------------------------------------------------ entry point

    async def handle(self, request: Request, route: str) -> Response:
        exchange = Exchange(request_id_for(request.headers), route, self._finish)
        response = await self._respond(request, exchange)
        decision = exchange.decision
        if self._debug_headers and decision is not None and wants_route_explain(request.headers):
            response.headers[ROUTE_EXPLAIN] = route_explain_value(decision)
        return response

    async def _respond(self, request: Request, exchange: Exchange) -> Response:
        headers = request.headers
        rid = exchange.request_id
        try:
            trusted = self._keys.authenticate(headers)
            body = decode_body(await read_body(request, self._max_body))
            passthrough = "kv_transfer_params" in body.data
            if passthrough and not trusted:
                raise ClientRequestError(
                    400,
                    "kv_transfer_params may not be set by clients",
                    code="kv_transfer_params_not_allowed",
                )
        except ClientRequestError as exc:
            exchange.status = exc.status
            await exchange.finish(False)
            return client_error_response(exc, self._client_headers(exchange))
        except ClientDisconnect:
            exchange.status = CLIENT_CLOSED_STATUS
            await exchange.finish(False)
            return Response(status_code=CLIENT_CLOSED_STATUS)

        canceller = RequestCanceller(request.receive)
        exchange.canceller = canceller
        exchange.stage = "queue"
        handed_off = False
        try:
            with canceller.armed():
                await self._admission.acquire()
            exchange.admitted = True
            exchange.stage = "route"
            response = await self._serve(exchange, body, headers, canceller, passthrough)
            handed_off = isinstance(response, RelayResponse)
            return response
        except asyncio.CancelledError as exc:
            if not canceller.owns(exc):
                raise
            self._metrics.disconnect_aborts.labels(stage=exchange.stage).inc()
            log.info("request %s: client disconnected; legs cancelled", rid)
            exchange.status = CLIENT_CLOSED_STATUS
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except ClientRequestError as exc:
            exchange.status = exc.status
            return client_error_response(exc, self._client_headers(exchange))
        except NoBackendAvailable as exc:
            exchange.status = 503
            return error_response(
                503, str(exc) or "no healthy backend", code="no_backend_available",
                headers={**self._client_headers(exchange), "retry-after": "1"},
            )  # fmt: skip
        except LegRefused as exc:
            exchange.status = exc.status
            return Response(
                exc.body,
                status_code=exc.status,
                headers=self._client_headers(exchange),
                media_type=exc.content_type or "application/json",
            )
        except LegFailed as exc:
            exchange.status = 504 if exc.timed_out else 502
            return error_response(
                exchange.status,
                f"upstream failed: {exc}",
                error_type="upstream_error",
                code="upstream_timeout" if exchange.status == 504 else "upstream_failed",
                headers=self._client_headers(exchange),
            )
        finally:
            if not handed_off:
                await exchange.finish(200 <= exchange.status < 300)

    # ------------------------------------------------------------------ the legs

    async def _serve(
        self,
        ex: Exchange,
        body: ClientBody,
        headers: Headers,
        canceller: RequestCanceller,
        passthrough: bool,
    ) -> Response:
        t = time.perf_counter()
        all_consumers = self._registry.consumers()
        if not all_consumers:
            raise NoBackendAvailable("no healthy consumer backend")
        all_producers = [] if passthrough else self._registry.producers()
        ex.decision = await self._router.route(
            RouteRequest(ex.request_id, ex.route, body.data), all_producers, all_consumers
        )
        # Server-Timing's ``route``: the router's own decision time when it reports one (the
        # KV router: tokenize, hash, match, score, record), else the time the call took here.
        ex.route_s = ex.decision.route_time_s or time.perf_counter() - t
        consumers = self._resolve(ex.decision.consumers)
        if not consumers:
            raise NoBackendAvailable("the router chose no consumer")
        dialect = consumers[0].dialect
        consumers = [c for c in consumers if c.dialect is dialect]
        producers: list[Backend] = []
        if dialect is not Dialect.NONE and not passthrough:
            producers = [p for p in self._resolve(ex.decision.producers) if p.dialect is dialect]
        ex.dialect = dialect.value
        base = upstream_base_headers(headers, ex.request_id)

        kv_params: dict[str, Any] | None = None
        supply: Supply | None = None
        if producers:
            ex.stage = "producer"
            answered = await self._producers.run(ex, body, producers, dialect, base)
            if answered is None:
                if not self._retries.fallback_to_consumer:
                    raise LegFailed("producers", "every producer attempt failed")
                ex.fallback = True
                self._metrics.fallbacks.inc()
                log.warning("request %s: producers failed; consumer serves alone", ex.request_id)
            else:
                kv_params, supply = answered
        stream = body.data.get("stream") is True
        ex.stage = "consumer"
        return await self._consumer_phase(
            ex,
            leg=consumer_body(body, kv_params),
            consumers=consumers,
            base=base,
            canceller=canceller,
            stream=stream,
            supply=supply,
        )

    async def _consumer_phase(
        self,
        ex: Exchange,
        *,
        leg: bytes,
        consumers: list[Backend],
        base: dict[str, str],
        canceller: RequestCanceller,
        stream: bool,
        supply: Supply | None,
    ) -> Response:
        path = ROUTE_PATHS[ex.route]
        t = time.perf_counter()
        failure: LegFailed | None = None
        committed = False
        try:
            for attempt, consumer in enumerate(consumers[: self._retries.consumer_attempts]):
                if attempt:
                    ex.retries += 1
                    self._metrics.retries.labels(leg="consumer").inc()
                    with canceller.armed():
                        await asyncio.sleep(self._producers.backoff(attempt))
                consumer.begin()
                try:
                    with canceller.armed():
                        opened = await self._upstream.open_consumer_leg(
                            consumer, path, leg, with_backend_auth(base, consumer.auth_header),
                            stream,
                        )  # fmt: skip
                except LegFailed as exc:
                    consumer.end()
                    consumer.breaker.record_failure()
                    log.warning("request %s: consumer leg failed: %s", ex.request_id, exc)
                    failure = exc
                    continue
                except LegRefused:
                    consumer.end()
                    consumer.breaker.record_success()
                    ex.consumer = consumer.name
                    committed = True  # the consumer answered: the supply is its business
                    raise
                except BaseException:
                    consumer.end()
                    consumer.breaker.record_abandoned()
                    raise
                consumer.breaker.record_success()
                committed = True
                ex.consumer = consumer.name
                ex.consumer_first_byte_s = time.perf_counter() - t
                ex.status = opened.response.status
                headers = self._client_headers(ex)
                for name in _RELAYED_HEADERS:
                    value = opened.response.headers.get(name)
                    if value is not None:
                        headers[name] = value
                self._metrics.observe_ttfb(ex.route, time.perf_counter() - ex.t0)
                if opened.complete:
                    consumer.end()
                    ex.cached_tokens = find_cached_tokens(opened.first)
                    self._metrics.observe_leg("consumer", consumer.name, time.perf_counter() - t)
                    return Response(opened.first, status_code=ex.status, headers=headers)
                return RelayResponse(
                    exchange=ex,
                    upstream=opened.response,
                    first=opened.first,
                    status=ex.status,
                    headers=headers,
                    canceller=canceller,
                    idle_s=self._idle_s,
                    on_end=self._stream_ended_callback(consumer, supply, t),
                )
            raise failure or NoBackendAvailable("no consumer to try")
        finally:
            if not committed and supply is not None:
                self._releaser.release(supply, ex.request_id)

    def _stream_ended_callback(
        self, consumer: Backend, supply: Supply | None, t: float
    ) -> Callable[[Exchange, str | None], Awaitable[None]]:
        async def ended(ex: Exchange, failure: str | None) -> None:
            consumer.end()
            self._metrics.observe_leg("consumer", consumer.name, time.perf_counter() - t)
            if failure is not None:
                if failure == CLIENT_DISCONNECT:
                    self._metrics.disconnect_aborts.labels(stage="stream").inc()
                    log.info("request %s: client left mid-stream", ex.request_id)
                else:
                    consumer.breaker.record_failure()
                if supply is not None:
                    self._releaser.release(supply, ex.request_id)
            await ex.finish(failure is None)

        return ended

    # ------------------------------------------------------------------ helpers

    def _resolve(self, views: Sequence[BackendView]) -> list[Backend]:
        out: list[Backend] = []
        for view in views:
            backend = view if isinstance(view, Backend) else self._registry.get(view.name)
            if backend is not None:
                out.append(backend)
        return out

    def _client_headers(self, ex: Exchange) -> dict[str, str]:
        headers = {REQUEST_ID: ex.request_id}
        if self._settings.server_timing:
            headers["server-timing"] = ex.server_timing()
        if ex.retries:
            headers[RETRIES_HEADER] = str(ex.retries)
        if ex.fallback:
            headers[FALLBACK_HEADER] = "consumer-only"
        return headers

    async def _finish(self, ex: Exchange, ok: bool) -> None:
        if ex.canceller is not None:
            ex.canceller.close()
        if ex.admitted:
            ex.admitted = False
            self._admission.release()
        self._metrics.count_request(ex.route, ex.status, ex.dialect)
        await report_to_router(self._router, ex, ok)

    async def drain_background(self, timeout_s: float) -> None:
        """Wait (bounded) for pending P2P releases; used at shutdown."""
        await self._releaser.drain(timeout_s)
