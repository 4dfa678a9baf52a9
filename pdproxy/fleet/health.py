"""Active health checks: GET each backend's health path on an interval.

A backend turns unhealthy after ``unhealthy_threshold`` consecutive failed checks and healthy
again after ``healthy_threshold`` consecutive good ones, so an ejected backend comes back by
itself. Checks run concurrently and are bounded by the health-check timeout.

:meth:`HealthChecker.confirm` is the breaker's witness: a request that failed on every backend
it tried cannot tell whose fault it was, so each backend it suspects is checked at once (at
most one check in flight per backend, whether or not periodic checks are enabled) and the
breaker counts the failure only when the check fails too.

``on_healthy`` runs after every good periodic check (the proxy learns the backend's models
there, so a model loaded later is picked up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvtier.tasks import cancel_and_wait
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.settings import HealthSettings
from pdproxy.upstream.client import Upstream

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        settings: HealthSettings,
        registry: BackendRegistry,
        upstream: Upstream,
        metrics: ProxyMetrics | None = None,
        on_healthy: Callable[[Backend], Awaitable[None]] | None = None,
    ) -> None:
        self._settings = settings
        self._registry = registry
        self._upstream = upstream
        self._metrics = metrics
        self._on_healthy = on_healthy
        self._task: asyncio.Task[None] | None = None
        self._confirming: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        if self._settings.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        confirming = list(self._confirming.values())
        self._confirming.clear()
        for task in confirming:
            task.cancel()
        await asyncio.gather(*confirming, return_exceptions=True)
        running, self._task = self._task, None
        await cancel_and_wait(running)

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self._settings.interval_s)

    async def check_all(self) -> None:
        backends = self._registry.all()
        if backends:
            await asyncio.gather(*(self.check(b) for b in backends))

    async def check(self, backend: Backend) -> None:
        ok = await self._probe(backend)
        self.record(backend, ok)
        if ok and self._on_healthy is not None:
            await self._on_healthy(backend)

    async def _probe(self, backend: Backend) -> bool:
        try:
            status, _ = await self._upstream.get(
                backend.url + backend.config.health_path,
                {"authorization": backend.auth_header} if backend.auth_header else None,
            )
        except Exception as exc:
            log.debug("health check of %s failed: %r", backend.name, exc)
            return False
        return status < 400

    def confirm(self, backend: Backend) -> None:
        """Check ``backend`` now; its breaker counts a failure only if the check fails."""
        if backend.name in self._confirming:
            return
        task = asyncio.get_running_loop().create_task(self._confirm(backend))
        self._confirming[backend.name] = task

    async def _confirm(self, backend: Backend) -> None:
        try:
            ok = await self._probe(backend)
        finally:
            self._confirming.pop(backend.name, None)
        if self._metrics is not None:
            self._metrics.breaker_confirmations.labels(
                backend.name, "healthy" if ok else "failed"
            ).inc()
        if not ok:
            backend.breaker.record_failure()

    def record(self, backend: Backend, ok: bool) -> None:
        s = self._settings
        if ok:
            backend.health_failures = 0
            backend.health_successes += 1
            if not backend.healthy and backend.health_successes >= s.healthy_threshold:
                backend.healthy = True
                log.info("backend %s is healthy again", backend.name)
        else:
            backend.health_successes = 0
            backend.health_failures += 1
            if backend.healthy and backend.health_failures >= s.unhealthy_threshold:
                backend.healthy = False
                log.warning("backend %s is unhealthy; ejected", backend.name)
