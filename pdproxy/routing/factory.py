"""Choose the router named by ``settings.router``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdproxy.errors import ConfigError
from pdproxy.routing.base import Router
from pdproxy.routing.simple import LeastLoadedRouter, RoundRobinRouter

if TYPE_CHECKING:
    from pdproxy.backends import BackendRegistry
    from pdproxy.settings import ProxySettings


def build_router(settings: ProxySettings, *, registry: BackendRegistry | None = None) -> Router:
    """Build the configured router. ``registry`` is the live backend set, for routers that
    need more than the candidates handed to ``route`` (the KV-aware router's event feeds)."""
    if settings.router == "round_robin":
        return RoundRobinRouter()
    if settings.router == "least_loaded":
        return LeastLoadedRouter()
    if settings.router == "kv":
        from pdproxy.routing.kv.build import build_kv_router, parse_settings

        return build_kv_router(parse_settings(settings.router_options), backends=registry)
    raise ConfigError(f"unknown router {settings.router!r}")
