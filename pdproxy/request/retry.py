"""Retries of both phases: attempt counts, a time budget, jittered exponential backoff.

One :class:`RetryPolicy` serves the producer and the consumer phase, so the two cannot drift
apart. The pause before a retry is cancellable by the client leaving (it runs armed).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Literal

from pdproxy.front.cancel import RequestCanceller
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.settings import RetrySettings

Leg = Literal["producer", "consumer"]
NO_DEADLINE = float("inf")


class RetryPolicy:
    def __init__(self, settings: RetrySettings, metrics: ProxyMetrics) -> None:
        self._settings = settings
        self._metrics = metrics
        self._rng = random.Random()
        self.producer_attempts = settings.producer_attempts
        self.consumer_attempts = settings.consumer_attempts
        self.producer_budget_s = settings.budget_s
        """How long the producer phase may retry; consumers have no budget (``NO_DEADLINE``):
        a consumer is the last resort."""

    def backoff(self, attempt: int) -> float:
        """Uniform in [cap/2, cap], the cap doubling per retry up to ``backoff_max_s``."""
        s = self._settings
        cap = min(s.backoff_max_s, s.backoff_base_s * (2 ** (attempt - 1)))
        return self._rng.uniform(cap / 2, cap)

    async def pause(
        self, leg: Leg, attempt: int, deadline: float, canceller: RequestCanceller
    ) -> bool:
        """Before retry ``attempt`` (1, 2...): False when the budget does not allow it, else
        wait the backoff (the client leaving cancels it) and count the retry."""
        delay = self.backoff(attempt)
        if time.perf_counter() + delay >= deadline:
            return False
        self._metrics.retries.labels(leg=leg).inc()
        with canceller.armed():
            await asyncio.sleep(delay)
        return True
