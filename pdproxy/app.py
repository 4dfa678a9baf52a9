"""``create_app(settings)``: the FastAPI application, with no module-level state.

The hot routes are plain Starlette routes (no FastAPI dependency solving, no
``BaseHTTPMiddleware``); everything the app needs hangs off one :class:`ProxyState`.

Who may connect: any client that reaches the listener. With ``api_keys`` set, the completion
routes and ``/v1/models`` need a key (trusted keys may also pass ``kv_transfer_params``);
``/health``, ``/ready`` and ``/metrics`` are open (bind the listener accordingly); ``/admin``
needs the admin key and is off without one (checked before any admin body is read). What a
client can make the proxy do: one admitted request at a time per slot (``admission``), bodies
bounded in size and read time, request heads bounded in size and time, connections capped
while a request is in progress and while waiting for one (enforced by ``pdproxy serve``'s
protocol: :mod:`pdproxy.front.connections`), upstream legs only to configured backends (and to
those DNS discovery or authenticated worker registration added: ``pdproxy.fleet.membership``,
whose registration socket has its own threat model in
``pdproxy/fleet/membership/registration.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdproxy import __version__
from pdproxy.admin import MAX_ADMIN_BODY_BYTES, AdminApi
from pdproxy.errors import ClientRequestError, ConfigError
from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.health import HealthChecker
from pdproxy.fleet.membership.service import MembershipService
from pdproxy.fleet.models import ModelCatalog, ModelLearner, ModelList
from pdproxy.front.admission import Admission, ModelAdmission, ModelMetrics
from pdproxy.front.connections import ConnectionGate, ConnectionMetrics
from pdproxy.front.intake import ENDPOINTS, ClientKeys, Endpoint
from pdproxy.front.request import HotRequest
from pdproxy.front.responses import client_error_response, error_response
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.path import RequestPath
from pdproxy.routing.base import Router
from pdproxy.routing.factory import build_router
from pdproxy.serve.metrics_merge import SAMPLES_TYPE, MergedMetrics, samples_json
from pdproxy.serve.siblings import Siblings
from pdproxy.settings import Dialect, ProxySettings
from pdproxy.settings.tracing import OtelSettings
from pdproxy.upstream.client import Upstream

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pdproxy.request.trace import RequestTracer

log = logging.getLogger(__name__)


class ProxyState:
    """Everything one proxy app owns."""

    def __init__(
        self,
        settings: ProxySettings,
        router: Router | None = None,
        clock: Callable[[], float] = time.monotonic,
        span_exporter: SpanExporter | None = None,
        siblings: Siblings | None = None,
    ) -> None:
        self.settings = settings
        self.siblings = siblings
        """The other processes of a ``serve --workers N`` group; None when alone."""
        self.registry = BackendRegistry(settings.breaker, clock)
        for config in settings.backends:
            self.registry.add(config)
        self.keys = ClientKeys(settings.api_keys, share_prefixes=settings.tenants.share_prefixes)
        """The client keys, for the completion routes and ``/v1/models`` alike."""
        self.admission = Admission(settings.admission)
        self.metrics = ProxyMetrics(self.registry, lambda: self.admission.queue_depth)
        self.connections = ConnectionGate(settings.admission)
        """Client connections waiting for a request head (used by ``pdproxy serve``'s protocol)."""
        self.metrics.registry.register(ConnectionMetrics(self.connections))
        self.catalog = ModelCatalog(settings.models, self.registry)
        self.model_admission = ModelAdmission(settings.models)
        self.model_metrics = ModelMetrics(self.metrics.registry, self.model_admission)
        self.catalog.on_forget(self.model_admission.forget)
        self.router = (
            router
            if router is not None
            else build_router(
                settings,
                registry=self.registry,
                metrics_registry=self.metrics.registry,
                catalog=self.catalog,
            )
        )
        self.upstream = Upstream(settings.timeouts, settings.upstream)
        learner = ModelLearner(self.catalog, self.upstream) if settings.models.learn else None
        self.health = HealthChecker(
            settings.health, self.registry, self.upstream, self.metrics, on_healthy=learner
        )
        self.models = ModelList(
            self.registry, self.upstream, settings.models_cache_s, settings.models.max_list_bytes
        )
        self.tracer = build_request_tracer(settings.tracing, span_exporter)
        self.membership = MembershipService(
            settings.membership, self.registry, clock=clock,
            metrics_registry=self.metrics.registry,
        )  # fmt: skip
        self.request_path = RequestPath(
            settings=settings,
            keys=self.keys,
            registry=self.registry,
            router=self.router,
            upstream=self.upstream,
            metrics=self.metrics,
            admission=self.admission,
            health=self.health,
            tracer=self.tracer,
            catalog=self.catalog,
            model_admission=self.model_admission,
        )
        admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
        self.admin = AdminApi(
            self.registry, admin_key, self.membership,
            body_read_timeout_s=settings.admission.body_read_timeout_s,
        )  # fmt: skip
        self.merged_metrics = (
            MergedMetrics(
                siblings, self.metrics.registry, max_age_s=settings.metrics_cache_s, clock=clock
            )
            if siblings is not None
            else None
        )
        """``/metrics`` over the shared port of a ``serve --workers N`` group."""
        self.draining = False

    def begin_drain(self) -> None:
        """SIGTERM: readiness goes false; in-flight requests carry on."""
        if not self.draining:
            log.info("draining: readiness is now false")
        self.draining = True

    async def start(self) -> None:
        for backend in self.registry.all():
            if backend.dialect is not Dialect.NONE and backend.config.kv_address is None:
                log.warning(
                    "backend %s has no kv_address: the KV address its answers name is not "
                    "checked", backend.name,
                )  # fmt: skip
        await self.router.start()
        await self.health.start()
        await self.membership.start()

    async def close(self) -> None:
        await self.membership.close()
        await self.health.close()
        await self.models.close()
        await self.request_path.drain_background(self.settings.timeouts.release_s)
        await self.router.close()
        await self.upstream.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # flushes the last spans


class ProxyApp(FastAPI):
    """FastAPI with a fast path: the two completion routes skip the middleware stack.

    Everything else (health, metrics, admin, lifespan) goes through FastAPI as usual.
    """

    pdproxy_state: ProxyState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = ENDPOINTS.get(scope["path"])
            if endpoint is not None:
                request = HotRequest(scope, receive)
                response = await self.pdproxy_state.request_path.answer(request, endpoint)
                await response(scope, receive, send)
                return
        state = self.pdproxy_state
        if state.siblings is not None and state.siblings.is_admin_change_to_share(scope):
            # The key first: the body of a change to replay is read whole, and only for callers
            # allowed to make it (one process answers 401 before any body too).
            refused = state.admin.refusal(Headers(scope=scope))
            if refused is not None:
                await refused(scope, receive, send)
                return
            await state.siblings.share_admin_change(
                super().__call__, scope, receive, send, max_body=MAX_ADMIN_BODY_BYTES,
                timeout_s=state.settings.admission.body_read_timeout_s,
            )  # fmt: skip
            return
        await super().__call__(scope, receive, send)


def _json(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def create_app(
    settings: ProxySettings,
    *,
    router: Router | None = None,
    clock: Callable[[], float] = time.monotonic,
    span_exporter: SpanExporter | None = None,
    siblings: Siblings | None = None,
) -> ProxyApp:
    """Build a proxy app. ``router`` overrides ``settings.router`` (tests, embedding); a router
    built from settings registers its metrics on the app's registry (``/metrics``), an injected
    one keeps its own. ``span_exporter`` turns tracing on with that exporter instead of the
    ``OTEL_*`` settings' one (:mod:`pdproxy.settings.tracing`). ``siblings``: the other processes
    of a ``serve --workers N`` group (``/metrics`` adds theirs up, admin changes reach them all)."""
    state = ProxyState(settings, router, clock, span_exporter, siblings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    app = ProxyApp(
        title="pdproxy",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.pdproxy = state
    app.pdproxy_state = state
    path = state.request_path
    keys = state.keys

    def serving(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        """The route of ``endpoint`` when the fast path is bypassed (FastAPI's own dispatch)."""

        async def route(request: Request) -> Response:
            return await path.handle(request, endpoint)

        return route

    async def models(request: Request) -> Response:
        try:
            keys.authenticate(request.headers)
        except ClientRequestError as exc:
            return client_error_response(exc)
        return Response(await state.models.body(), media_type="application/json")

    async def health(_: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(_: Request) -> Response:
        if state.draining:
            return _json({"ready": False, "reason": "draining"}, 503)
        if not state.registry.ready():
            return _json({"ready": False, "reason": "no healthy producer/consumer"}, 503)
        return _json({"ready": True})

    async def metrics(request: Request) -> Response:
        if siblings is None or state.merged_metrics is None:
            return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
        if not siblings.is_sibling_request(request.scope.get("server")):
            return Response(await state.merged_metrics.scrape(), media_type=CONTENT_TYPE_LATEST)
        if request.headers.get("accept") == SAMPLES_TYPE:  # a sibling merging the group's
            return Response(samples_json(state.metrics.registry), media_type=SAMPLES_TYPE)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(
            exc.status_code,
            str(exc.detail),
            error_type="invalid_request_error",
            code="not_found" if exc.status_code == 404 else "method_not_allowed"
            if exc.status_code == 405 else "http_error",
        )  # fmt: skip

    app.add_exception_handler(StarletteHTTPException, http_error)
    for endpoint in Endpoint:
        app.add_route(endpoint.path, serving(endpoint), methods=["POST"])
    app.add_route("/v1/models", models, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/ready", ready, methods=["GET"])
    app.add_route("/metrics", metrics, methods=["GET"])
    app.router.routes.extend(state.admin.routes())
    return app


def proxy_state(app: FastAPI) -> ProxyState:
    """The :class:`ProxyState` of an app made by :func:`create_app`."""
    state = app.state.pdproxy
    assert isinstance(state, ProxyState)
    return state


def build_request_tracer(
    settings: OtelSettings, exporter: SpanExporter | None = None
) -> RequestTracer | None:
    """The request tracer, or None when tracing is off (and ``exporter`` is None).

    ``exporter`` replaces the configured one and turns tracing on (tests, embedding); its spans
    are handed over as each ends. Raises :class:`~pdproxy.errors.ConfigError` when tracing is
    on but the ``pdproxy[otel]`` extra is not installed.
    """
    if exporter is None and not settings.enabled:
        return None
    try:
        from pdproxy.request.trace import RequestTracer
    except ImportError as exc:
        raise ConfigError(
            f"tracing is on ({settings.exporter} exporter) but OpenTelemetry is not installed: "
            "pip install 'pdproxy[otel]'"
        ) from exc
    return RequestTracer.from_settings(settings, exporter)
