"""Build :class:`~pdproxy.routing.per_model.PerModelRouter` from the proxy settings: a KV
router per model, each from :func:`pdproxy.routing.kv.build.build_kv_router`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdproxy.routing.base import Router
from pdproxy.routing.kv.build import build_kv_router, parse_settings
from pdproxy.routing.per_model import (
    ModelEventSource,
    PerModelRouter,
    RouterMetricsView,
    check_distinct_seeds,
    model_router_options,
)

if TYPE_CHECKING:
    from pdproxy.fleet.backends import BackendRegistry
    from pdproxy.fleet.models import ModelCatalog
    from pdproxy.settings import ProxySettings


def build_per_model_router(
    settings: ProxySettings,
    catalog: ModelCatalog,
    registry: BackendRegistry | None,
    metrics_registry: CollectorRegistry | None,
    *,
    ranks: bool = False,
) -> PerModelRouter:
    check_distinct_seeds(settings, catalog)
    view = RouterMetricsView()
    default_metrics = CollectorRegistry()
    view.add(None, default_metrics)
    default = build_kv_router(
        parse_settings({**settings.router_options, "events": {}, "replay": {}}),
        metrics_registry=default_metrics,
    )

    def build(model: str) -> Router:
        options = model_router_options(settings, catalog, model)
        own_metrics = CollectorRegistry()
        adapter = catalog.base_of(model) is not None
        router = build_kv_router(
            parse_settings(options),
            backends=ModelEventSource(registry, model, ranks=ranks)
            if registry is not None and not adapter
            else None,
            metrics_registry=own_metrics,
        )
        view.add(model, own_metrics)
        return router

    if metrics_registry is not None:
        metrics_registry.register(view)
    return PerModelRouter(
        default=default, build=build, configured=catalog.configured(), known=catalog.known
    )
