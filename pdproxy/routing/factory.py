"""Choose and build the router named by ``settings.router``: a load-only router, the KV router,
or one KV router per model; wrapped to route per data-parallel rank when the fleet has ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdproxy.errors import ConfigError
from pdproxy.routing.base import Router
from pdproxy.routing.per_model import (
    PerModelRouter,
    RouterMetricsView,
    check_distinct_seeds,
    model_router_settings,
)
from pdproxy.routing.simple import LeastLoadedRouter, RoundRobinRouter
from pdproxy.settings import parse_router_options

if TYPE_CHECKING:
    from pdproxy.fleet.backends import BackendRegistry
    from pdproxy.fleet.models import ModelCatalog
    from pdproxy.settings import ProxySettings


def routes_ranks(settings: ProxySettings) -> bool:
    """Whether the router is wrapped in :class:`~pdproxy.routing.dp_router.DpRankRouter`."""
    mode = settings.data_parallel_routing
    if mode == "auto":
        return any(b.data_parallel_size > 1 for b in settings.backends)
    return mode == "on"


def build_router(
    settings: ProxySettings,
    *,
    registry: BackendRegistry | None = None,
    metrics_registry: CollectorRegistry | None = None,
    catalog: ModelCatalog | None = None,
) -> Router:
    """:func:`build_plain_router`, wrapped to route per data-parallel rank when
    :func:`routes_ranks` says so."""
    ranks = routes_ranks(settings)
    router = build_plain_router(
        settings, registry=registry, metrics_registry=metrics_registry, catalog=catalog,
        ranks=ranks,
    )  # fmt: skip
    if not ranks:
        return router
    from pdproxy.routing.dp_router import DpRankMetrics, DpRankRouter

    return DpRankRouter(router, DpRankMetrics(metrics_registry))


def build_plain_router(
    settings: ProxySettings,
    *,
    registry: BackendRegistry | None = None,
    metrics_registry: CollectorRegistry | None = None,
    catalog: ModelCatalog | None = None,
    ranks: bool = False,
) -> Router:
    """Build the configured router. ``registry`` is the live backend set, for routers that
    need more than the candidates handed to ``route`` (the KV-aware router's event feeds);
    ``metrics_registry`` is where a router with metrics of its own registers them (the proxy
    passes its own, so ``/metrics`` shows them). With ``catalog`` naming models (configured on
    backends or under ``models.served``), the KV router is one per model
    (:mod:`pdproxy.routing.per_model`)."""
    if settings.router == "round_robin":
        return RoundRobinRouter()
    if settings.router == "least_loaded":
        return LeastLoadedRouter()
    if settings.router == "kv" and catalog is not None and catalog.configured():
        return build_per_model_router(settings, catalog, registry, metrics_registry, ranks=ranks)
    if settings.router == "kv":
        from pdproxy.routing.kv.build import RegistryEventSource, build_kv_router

        return build_kv_router(
            parse_router_options(settings.router_options),
            backends=RegistryEventSource(registry, ranks=ranks) if registry is not None else None,
            metrics_registry=metrics_registry,
        )
    raise ConfigError(f"unknown router {settings.router!r}")


def build_per_model_router(
    settings: ProxySettings,
    catalog: ModelCatalog,
    registry: BackendRegistry | None,
    metrics_registry: CollectorRegistry | None,
    *,
    ranks: bool = False,
) -> PerModelRouter:
    """A KV router per model (:mod:`pdproxy.routing.per_model`), each with a metrics registry
    of its own shown on ``metrics_registry`` through one :class:`RouterMetricsView`."""
    from pdproxy.routing.kv.build import RegistryEventSource, build_kv_router

    check_distinct_seeds(settings, catalog)
    view = RouterMetricsView()
    default_metrics = CollectorRegistry()
    view.add(None, default_metrics)
    default = build_kv_router(
        parse_router_options(settings.router_options).model_copy(
            update={"events": {}, "replay": {}}
        ),
        metrics_registry=default_metrics,
    )

    def build(model: str) -> Router:
        own_metrics = CollectorRegistry()
        adapter = catalog.base_of(model) is not None
        router = build_kv_router(
            model_router_settings(settings, catalog, model),
            backends=RegistryEventSource(registry, ranks=ranks, model=model)
            if registry is not None and not adapter
            else None,
            metrics_registry=own_metrics,
        )
        view.add(model, own_metrics)
        return router

    if metrics_registry is not None:
        metrics_registry.register(view)
    router = PerModelRouter(
        default=default,
        build=build,
        configured=catalog.configured(),
        known=catalog.known,
        dropped=view.remove,
    )
    catalog.on_forget(router.forget)
    return router
