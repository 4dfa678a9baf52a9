"""Per-request bookkeeping: timings, the decision, and a finish that runs exactly once."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

from pdproxy.cancel import RequestCanceller
from pdproxy.routing.base import RequestOutcome, RouteDecision, Router

log = logging.getLogger(__name__)

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def find_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a consumer body or its last chunks."""
    found = _CACHED_TOKENS.findall(data)
    return int(found[-1]) if found else None


class Exchange:
    """One client request: what was chosen, what happened, and when."""

    __slots__ = (
        "_on_finish",
        "admitted",
        "cached_tokens",
        "canceller",
        "consumer",
        "consumer_first_byte_s",
        "decision",
        "dialect",
        "fallback",
        "finished",
        "producer",
        "producer_s",
        "request_id",
        "retries",
        "route",
        "route_s",
        "stage",
        "status",
        "t0",
    )

    def __init__(
        self,
        request_id: str,
        route: str,
        on_finish: Callable[[Exchange, bool], Awaitable[None]],
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.t0 = time.perf_counter()
        self._on_finish = on_finish
        self.decision: RouteDecision | None = None
        self.dialect = "none"
        self.producer: str | None = None
        self.consumer: str | None = None
        self.cached_tokens: int | None = None
        self.retries = 0
        self.fallback = False
        self.status = 0
        self.route_s = 0.0
        self.producer_s = 0.0
        self.consumer_first_byte_s = 0.0
        self.finished = False
        self.stage = "read"
        """Where the request is: read, queue, route, producer, consumer, stream."""
        self.admitted = False
        self.canceller: RequestCanceller | None = None

    def server_timing(self) -> str:
        parts = [f"route;dur={self.route_s * 1000:.3f}"]
        if self.producer_s:
            parts.append(f"producer;dur={self.producer_s * 1000:.3f}")
        if self.consumer_first_byte_s:
            parts.append(f"consumer_fb;dur={self.consumer_first_byte_s * 1000:.3f}")
        return ", ".join(parts)

    async def finish(self, ok: bool) -> None:
        if self.finished:
            return
        self.finished = True
        await self._on_finish(self, ok)


async def report_to_router(router: Router, exchange: Exchange, ok: bool) -> None:
    """Call ``router.finished`` for the exchange's decision; never raises."""
    if exchange.decision is None:
        return
    outcome = RequestOutcome(
        producer=exchange.producer,
        consumer=exchange.consumer,
        ok=ok,
        cached_tokens=exchange.cached_tokens,
    )
    try:
        await router.finished(exchange.decision, outcome)
    except Exception:
        log.exception("router.finished failed for request %s", exchange.request_id)
