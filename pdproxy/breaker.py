"""A circuit breaker per backend, fed by request outcomes the backend is to blame for.

The request's lease (:mod:`pdproxy.lease`) decides what counts: a success records one; a failed
leg counts only once the same request succeeded elsewhere, or a health check failed too
(:meth:`pdproxy.health.HealthChecker.confirm`); a 4xx or an abandoned leg is no verdict.

Closed: traffic flows; ``failure_threshold`` consecutive failures open it. Open: no traffic for
``open_s``; then half-open: exactly one probe request is let through. The probe's success closes
the breaker, its failure opens it again. A probe that ends without an outcome (client gone)
frees the probe slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum

from pdproxy.settings import BreakerSettings


class BreakerState(IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    __slots__ = ("_clock", "_failures", "_opened_at", "_probe_in_flight", "_settings", "_state")

    def __init__(
        self, settings: BreakerSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_in_flight = False

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self._settings.open_s
        ):
            self._state = BreakerState.HALF_OPEN
            self._probe_in_flight = False
        return self._state

    def allows(self) -> bool:
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        return state is BreakerState.HALF_OPEN and not self._probe_in_flight

    def on_attempt(self) -> None:
        """A request is about to be sent; in half-open it becomes the one probe."""
        if self.state is BreakerState.HALF_OPEN:
            self._probe_in_flight = True

    def record_success(self) -> None:
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._probe_in_flight = False

    def record_failure(self) -> None:
        self._failures += 1
        threshold = self._settings.failure_threshold
        if self.state is BreakerState.HALF_OPEN or self._failures >= threshold:
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()
            self._probe_in_flight = False

    def record_abandoned(self) -> None:
        """The attempt ended without an outcome (cancelled): free the probe slot."""
        self._probe_in_flight = False
