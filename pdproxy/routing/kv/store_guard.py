"""Deadline and breaker for every call to the shared store (Redis).

Each call is bounded by ``deadline_s``. After ``failures`` consecutive failures the breaker
opens (failures less than one deadline apart count once: calls issued together that time out in
the same stall, e.g. the process descheduled on a busy machine, are one failure, not three).
An open breaker fails calls at once (the router routes by load alone) until ``cooldown_s`` has
passed, then lets one probe call through; its success closes the breaker. The state change is
logged once each way and reported through ``on_state`` (for the metric).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from enum import IntEnum
from typing import TypeVar

from kvtier.errors import ResidencyUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


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
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._on_state = on_state
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._last_counted = 0.0
        self._probing = False
        self.on_recovered: Callable[[], None] | None = None
        """Called when the breaker closes after being open (e.g. to resync shared state)."""

    @property
    def state(self) -> BreakerState:
        return self._state

    def allows(self) -> bool:
        """Whether a call now would reach the store (without starting it)."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            return self._clock() - self._opened_at >= self._cooldown_s
        return not self._probing

    async def call(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        """Run ``fn()`` under the deadline; raise ResidencyUnavailable when it cannot."""
        probe = False
        if self._state is not BreakerState.CLOSED:
            if not self.allows():
                raise ResidencyUnavailable(f"shared store breaker open ({what} skipped)")
            self._set_state(BreakerState.HALF_OPEN)
            self._probing = probe = True
        try:
            async with asyncio.timeout(self._deadline_s):  # no extra task, unlike wait_for
                result = await fn()
        except asyncio.CancelledError:
            if probe:
                self._probing = False
            raise
        except Exception as exc:
            self._failed(what, exc, probe)
            raise ResidencyUnavailable(f"shared store failed on {what}: {exc!r}") from exc
        self._succeeded(probe)
        return result

    def _failed(self, what: str, exc: BaseException, probe: bool) -> None:
        if probe:
            self._probing = False
        now = self._clock()
        if self._consecutive == 0 or now - self._last_counted >= self._deadline_s:
            self._consecutive += 1
            self._last_counted = now
        if probe or (self._state is BreakerState.CLOSED and self._consecutive >= self._threshold):
            self._opened_at = now
            if self._state is BreakerState.CLOSED:
                logger.warning(
                    "shared store unavailable (%s: %r); routing by load alone until it returns",
                    what,
                    exc,
                )
            self._set_state(BreakerState.OPEN)

    def _succeeded(self, probe: bool) -> None:
        self._consecutive = 0
        if probe:
            self._probing = False
        if self._state is not BreakerState.CLOSED:
            logger.warning("shared store reachable again; KV-aware routing resumes")
            self._set_state(BreakerState.CLOSED)
            if self.on_recovered is not None:
                self.on_recovered()

    def _set_state(self, state: BreakerState) -> None:
        if state is not self._state:
            self._state = state
            if self._on_state is not None:
                self._on_state(state)
