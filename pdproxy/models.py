"""``GET /v1/models``: the union of the model lists of all routable backends, cached briefly.

Behind the client key when keys are configured (the app checks it). Without the cache every
call would fan out to every backend: a cheap way to load them all. One fan-out at a time serves
every caller that arrives while it runs; its answer is reused for ``cache_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson

from pdproxy.backends import Backend, BackendRegistry
from pdproxy.upstream import Upstream

log = logging.getLogger(__name__)


async def _models_of(upstream: Upstream, backend: Backend) -> list[dict[str, Any]]:
    headers = {"authorization": backend.auth_header} if backend.auth_header else None
    try:
        status, body = await upstream.get(backend.url + "/v1/models", headers)
        if status >= 400:
            return []
        data = orjson.loads(body).get("data", [])
    except Exception as exc:
        log.debug("models of %s unavailable: %r", backend.name, exc)
        return []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def aggregate_models(registry: BackendRegistry, upstream: Upstream) -> dict[str, Any]:
    backends = [b for b in registry.all() if b.routable]
    lists = await asyncio.gather(*(_models_of(upstream, b) for b in backends))
    seen: dict[str, dict[str, Any]] = {}
    for models in lists:
        for model in models:
            seen.setdefault(model["id"], model)
    return {"object": "list", "data": list(seen.values())}


class ModelList:
    """The cached, single-flight model list."""

    def __init__(self, registry: BackendRegistry, upstream: Upstream, cache_s: float) -> None:
        self._registry = registry
        self._upstream = upstream
        self._cache_s = cache_s
        self._body = b""
        self._at = float("-inf")
        self._pending: asyncio.Task[bytes] | None = None

    async def body(self) -> bytes:
        """The JSON answer, from the cache while it is fresh."""
        if self._body and time.monotonic() - self._at < self._cache_s:
            return self._body
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_task(self._fetch())
        # shield: one caller leaving must not cancel the fan-out the others wait on
        return await asyncio.shield(self._pending)

    async def _fetch(self) -> bytes:
        try:
            body = orjson.dumps(await aggregate_models(self._registry, self._upstream))
            self._body, self._at = body, time.monotonic()
            return body
        finally:
            self._pending = None

    async def close(self) -> None:
        pending = self._pending
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
