"""Choose the router named by ``settings.router``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdproxy.errors import ConfigError
from pdproxy.routing.base import Router
from pdproxy.routing.simple import LeastLoadedRouter, RoundRobinRouter

if TYPE_CHECKING:
    from collections.abc import Iterable

    from prometheus_client import CollectorRegistry

    from pdproxy.fleet.backends import Backend, BackendRegistry
    from pdproxy.fleet.models import ModelCatalog
    from pdproxy.settings import ProxySettings


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    """A backend's KV event sockets, as the KV router's event feeds follow them."""

    name: str
    url: str
    events_endpoint: str | None
    events_replay_endpoint: str | None


class RegistryEventSource:
    """The live backend registry seen as event sources (read afresh on every ``all()``); with
    ``ranks``, one source per data-parallel rank (:func:`pdproxy.fleet.dp_ranks.rank_streams`)."""

    def __init__(self, registry: BackendRegistry, *, ranks: bool = False) -> None:
        self._registry = registry
        self._ranks = ranks

    def all(self) -> list[EventEndpoints]:
        return event_endpoints(self._registry.all(), ranks=self._ranks)


def event_endpoints(backends: Iterable[Backend], *, ranks: bool) -> list[EventEndpoints]:
    if not ranks:
        return [
            EventEndpoints(b.name, b.url, b.config.events_endpoint, b.config.events_replay_endpoint)
            for b in backends
        ]
    from pdproxy.fleet.dp_ranks import rank_streams

    return [
        EventEndpoints(node, b.url, endpoint, replay)
        for b in backends
        for node, endpoint, replay in rank_streams(
            b.name, b.data_parallel_size, b.config.events_endpoint, b.config.events_replay_endpoint
        )
    ]


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
        from pdproxy.routing.per_model_build import build_per_model_router

        return build_per_model_router(settings, catalog, registry, metrics_registry, ranks=ranks)
    if settings.router == "kv":
        from pdproxy.routing.kv.build import build_kv_router, parse_settings

        return build_kv_router(
            parse_settings(settings.router_options),
            backends=RegistryEventSource(registry, ranks=ranks) if registry is not None else None,
            metrics_registry=metrics_registry,
        )
    raise ConfigError(f"unknown router {settings.router!r}")
