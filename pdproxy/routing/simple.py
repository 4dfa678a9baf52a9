"""Load-only routers: round-robin and least-loaded.

Both rank every routable candidate, so retries and failover walk down the rest of the list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pdproxy.routing.base import (
    B,
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


class _LoadOnlyRouter:
    """Shared rotation; subclasses only decide how to order the rotated candidates."""

    reason = ""

    def __init__(self) -> None:
        self._turn = 0

    async def start(self) -> None:
        return None

    def _rank(self, candidates: list[B]) -> list[B]:
        return candidates

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[B],
        consumers: Sequence[B],
    ) -> RouteDecision[B]:
        if not consumers:
            raise NoBackendAvailable("no routable consumer")
        turn = self._turn
        self._turn = turn + 1
        return RouteDecision(
            request_id=request.request_id,
            consumers=self._rank(_rotated(consumers, turn)),
            producers=self._rank(_rotated(producers, turn)),
            reason=self.reason,
        )

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None


class RoundRobinRouter(_LoadOnlyRouter):
    """Each request starts one further along both lists."""

    reason = "round-robin"


class LeastLoadedRouter(_LoadOnlyRouter):
    """Fewest requests in flight first; ties broken round-robin so load spreads evenly."""

    reason = "least-loaded"

    def _rank(self, candidates: list[B]) -> list[B]:
        return sorted(candidates, key=lambda b: b.in_flight)  # stable: keeps the rotation
