"""The producer leg of one request: ranked producers, jittered backoff, bounded attempts.

A producer that fails (connect, timeout, 5xx, 429, an answer without usable
``kv_transfer_params``) is released (P2P supply) and the next one is tried, within an attempt
count and a time budget; ``None`` tells the caller to let the consumer prefill alone.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from pdproxy.backends import Backend
from pdproxy.body import ClientBody
from pdproxy.errors import LegFailed, LegRefused
from pdproxy.exchange import Exchange
from pdproxy.headers import with_backend_auth
from pdproxy.legs import consumer_kv_params, new_kv_request_id, producer_body, producer_kv_params
from pdproxy.metrics import ProxyMetrics
from pdproxy.release import Supply, SupplyReleaser
from pdproxy.settings import Dialect, RetrySettings
from pdproxy.upstream import Upstream

log = logging.getLogger(__name__)

ROUTE_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ProducerPhase:
    def __init__(
        self,
        upstream: Upstream,
        releaser: SupplyReleaser,
        metrics: ProxyMetrics,
        retries: RetrySettings,
    ) -> None:
        self._upstream = upstream
        self._releaser = releaser
        self._metrics = metrics
        self._retries = retries
        self._rng = random.Random()

    def backoff(self, attempt: int) -> float:
        """Full-jitter-ish exponential backoff: uniform in [cap/2, cap] for retry ``attempt``."""
        cap = min(self._retries.backoff_max_s, self._retries.backoff_base_s * (2 ** (attempt - 1)))
        return self._rng.uniform(cap / 2, cap)

    async def run(
        self,
        ex: Exchange,
        body: ClientBody,
        producers: list[Backend],
        dialect: Dialect,
        base: dict[str, str],
    ) -> tuple[dict[str, Any], Supply] | None:
        assert ex.canceller is not None
        canceller = ex.canceller
        path = ROUTE_PATHS[ex.route]
        t = time.perf_counter()
        deadline = t + self._retries.budget_s
        try:
            for attempt, producer in enumerate(producers[: self._retries.producer_attempts]):
                if attempt:
                    delay = self.backoff(attempt)
                    if time.perf_counter() + delay >= deadline:
                        break
                    ex.retries += 1
                    self._metrics.retries.labels(leg="producer").inc()
                    with canceller.armed():
                        await asyncio.sleep(delay)
                kv_id = new_kv_request_id()
                leg = producer_body(body, producer_kv_params(dialect, kv_id))
                t_leg = time.perf_counter()
                producer.begin()
                try:
                    with canceller.armed():
                        answer = await self._upstream.producer_leg(
                            producer, path, leg, with_backend_auth(base, producer.auth_header)
                        )
                    kv_params = consumer_kv_params(dialect, producer.name, answer, kv_id)
                except LegFailed as exc:
                    producer.breaker.record_failure()
                    log.warning("request %s: producer leg failed: %s", ex.request_id, exc)
                    self._releaser.release(Supply(producer, kv_id, dialect), ex.request_id)
                    continue
                except LegRefused:
                    producer.breaker.record_success()
                    raise
                except BaseException:
                    producer.breaker.record_abandoned()
                    self._releaser.release(Supply(producer, kv_id, dialect), ex.request_id)
                    raise
                finally:
                    producer.end()
                producer.breaker.record_success()
                self._metrics.observe_leg("producer", producer.name, time.perf_counter() - t_leg)
                ex.producer = producer.name
                return kv_params, Supply(producer, kv_id, dialect)
            return None
        finally:
            ex.producer_s = time.perf_counter() - t
