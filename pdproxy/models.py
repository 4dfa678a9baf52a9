"""``GET /v1/models``: the union of the model lists of all routable backends."""

from __future__ import annotations

import asyncio
import logging
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
