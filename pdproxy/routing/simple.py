"""Load-only routers: round-robin and least-loaded.

Both rank every routable candidate, so retries and failover walk down the rest of the list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pdproxy.routing.base import (
    BackendView,
    NoBackendAvailable,
    RequestOutcome,
    RouteDecision,
    RouteRequest,
)

_T = TypeVar("_T")


def _rotated(items: Sequence[_T], start: int) -> list[_T]:
    if not items:
        return []
    k = start % len(items)
    return [*items[k:], *items[:k]]


class RoundRobinRouter:
    """Each request starts one further along both lists."""

    def __init__(self) -> None:
        self._turn = 0

    async def start(self) -> None:
        return None

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision:
        if not consumers:
            raise NoBackendAvailable("no routable consumer")
        turn = self._turn
        self._turn = turn + 1
        return RouteDecision(
            consumers=_rotated(consumers, turn),
            producers=_rotated(producers, turn),
            reason="round-robin",
        )

    async def finished(self, decision: RouteDecision, outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None


class LeastLoadedRouter:
    """Fewest requests in flight first; ties broken round-robin so load spreads evenly."""

    def __init__(self) -> None:
        self._turn = 0

    async def start(self) -> None:
        return None

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision:
        if not consumers:
            raise NoBackendAvailable("no routable consumer")
        turn = self._turn
        self._turn = turn + 1
        return RouteDecision(
            consumers=sorted(_rotated(consumers, turn), key=lambda b: b.in_flight),
            producers=sorted(_rotated(producers, turn), key=lambda b: b.in_flight),
            reason="least-loaded",
        )

    async def finished(self, decision: RouteDecision, outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None
