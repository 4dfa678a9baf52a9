"""Fixtures shared by the router tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings


@pytest.fixture
async def router_factory() -> AsyncIterator[Callable[[KvRouterSettings], KvRouter]]:
    """Builds KV routers from settings (a shared index when they name one); every router built
    is closed when the test ends."""
    routers: list[KvRouter] = []

    def make(settings: KvRouterSettings) -> KvRouter:
        r = build_kv_router(settings, metrics_registry=CollectorRegistry())
        routers.append(r)
        return r

    try:
        yield make
    finally:
        for r in routers:
            await r.close()
