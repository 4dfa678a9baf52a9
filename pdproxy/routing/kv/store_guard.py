"""Deadline and breaker for every call the router makes to the shared store (Redis).

Each call is bounded by ``deadline_s`` (the one deadline of a router call: the Redis index and
load counters behind it apply none of their own). The breaker is the proxy's
:class:`pdproxy.fleet.backends.CircuitBreaker`: after ``failures`` consecutive failures it opens
(failures less than one deadline apart count once: calls issued together that time out in the
same stall, e.g. the process descheduled on a busy machine, are one failure, not three). An
open breaker fails calls at once (the router routes by load alone) until ``cooldown_s`` has
passed, then lets one probe call through; its success closes the breaker. The state change is
logged once each way and reported through ``on_state`` (for the metric).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvtier.errors import ResidencyUnavailable
from kvtier.tasks import CallerCancel
from pdproxy.fleet.backends import BreakerState, CircuitBreaker
from pdproxy.settings import BreakerSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["BreakerState", "StoreGuard"]


class StoreGuard:
    def __init__(
        self,
        *,
        deadline_s: float,
        failures: int,
        cooldown_s: float,
        on_state: Callable[[BreakerState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._deadline_s = deadline_s
        self._breaker = CircuitBreaker(
            BreakerSettings(failure_threshold=failures, open_s=cooldown_s), clock
        )
        self._on_state = on_state
        self._clock = clock
        self._reported = BreakerState.CLOSED
        self._last_counted: float | None = None
        self.on_recovered: Callable[[], None] | None = None
        """Called when the breaker closes after being open (e.g. to resync shared state)."""

    @property
    def state(self) -> BreakerState:
        return self._breaker.state

    @property
    def deadline_s(self) -> float:
        return self._deadline_s

    def allows(self) -> bool:
        """Whether a call now would reach the store (without starting it)."""
        return self._breaker.allows()

    async def call(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        """Run ``fn()`` under the deadline; raise ResidencyUnavailable when it cannot."""
        breaker = self._breaker
        if not breaker.allows():
            raise ResidencyUnavailable(f"shared store breaker open ({what} skipped)")
        breaker.on_attempt()
        self._report()
        cancel = CallerCancel()
        try:
            async with asyncio.timeout(self._deadline_s):  # no extra task, unlike wait_for
                result = await fn()
        except asyncio.CancelledError:
            breaker.record_abandoned()
            raise
        except Exception as exc:
            self._give_back_cancel(cancel, what, exc)
            self._failed(what, exc)
            raise ResidencyUnavailable(f"shared store failed on {what}: {exc!r}") from exc
        self._give_back_cancel(cancel, what, None)
        self._last_counted = None
        breaker.record_success()
        self._report()
        return result

    def _give_back_cancel(self, cancel: CallerCancel, what: str, cause: Exception | None) -> None:
        """Raise CancelledError if the caller was cancelled during the call, whatever the client
        made of it (the Redis client has answered anyway, or raised an error of its own: a
        closing router's heartbeat ran on, and close() waited for it forever); not the store's
        fault, so the breaker counts no failure."""
        if cancel.lost:
            self._breaker.record_abandoned()
            cancel.check(what, cause)

    def _failed(self, what: str, exc: BaseException) -> None:
        breaker = self._breaker
        now = self._clock()
        probe = breaker.state is BreakerState.HALF_OPEN
        last = self._last_counted
        if probe or last is None or now - last >= self._deadline_s:
            self._last_counted = now
            breaker.record_failure()
        if breaker.state is BreakerState.OPEN and self._reported is BreakerState.CLOSED:
            logger.warning(
                "shared store unavailable (%s: %r); routing by load alone until it returns",
                what,
                exc,
            )
        self._report()

    def _report(self) -> None:
        state = self._breaker.state
        if state is self._reported:
            return
        was, self._reported = self._reported, state
        if self._on_state is not None:
            self._on_state(state)
        if state is BreakerState.CLOSED and was is not BreakerState.CLOSED:
            logger.warning("shared store reachable again; KV-aware routing resumes")
            if self.on_recovered is not None:
                self.on_recovered()
