"""Which models the proxy knows, what a request's ``model`` resolves to, and learning models
from backends.

A model is known when the operator names it (``models.served``, a backend's ``models``) or a
backend's ``/v1/models`` lists it (vLLM lists loaded LoRA adapters there too, with their base
model as ``parent``). A request naming a model nobody serves gets OpenAI's 404
``model_not_found``, unless a backend whose list is not known yet could serve it.

Metric labels and per-model routers exist only for known models, at most ``models.max_learned``
names learned from backends on top of the configured ones: a client can never create a label or
a router by choosing a string.

``GET /v1/models``: the union of the model lists of all routable backends, cached briefly.

Behind the client key when keys are configured (the app checks it). Without the cache every
call would fan out to every backend: a cheap way to load them all. One fan-out at a time serves
every caller that arrives while it runs; its answer is reused for ``cache_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.errors import ClientRequestError, ModelNotFound
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.settings.models import MODEL_NAME_MAX, ModelsSettings, check_model_name
from pdproxy.upstream.client import Upstream

log = logging.getLogger(__name__)

OTHER_LABEL = "other"
"""The metric label of a request whose model is not known (served by a backend with no list)."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """What a request's ``model`` resolved to."""

    name: str
    base: str | None = None
    """Its base model when it is a LoRA adapter."""
    known: bool = True
    """False: no backend lists it, but backends whose list is unknown may serve it."""
    load_on_demand: bool = False

    @property
    def label(self) -> str:
        return self.name if self.known else OTHER_LABEL


class ModelCatalog:
    def __init__(self, settings: ModelsSettings, registry: BackendRegistry) -> None:
        self._settings = settings
        self._registry = registry
        self._learned: dict[str, None] = {}
        """Names learned from backends, in the order first seen (bounded)."""

    @property
    def settings(self) -> ModelsSettings:
        return self._settings

    def configured(self) -> list[str]:
        """Models named in the configuration (``models.served`` and backends' ``models``)."""
        names = dict.fromkeys(self._settings.served)
        for backend in self._registry.all():
            names.update(dict.fromkeys(backend.config.models))
        return list(names)

    def known(self) -> list[str]:
        names = dict.fromkeys(self.configured())
        names.update(self._learned)
        return list(names)

    def base_of(self, model: str) -> str | None:
        config = self._settings.served.get(model)
        if config is not None and config.base is not None:
            return config.base
        for backend in self._registry.all():
            if backend.models is not None:
                for adapter, base in backend.models.adapters:
                    if adapter == model:
                        return base
        return None

    def resolve(self, body: dict[str, Any]) -> ModelRef | None:
        """The request's model (None when it names none: any backend serves it). Raises
        :class:`ModelNotFound` (404) for a model no backend can serve, 400 for a non-string."""
        model = body.get("model")
        if model is None:
            return None
        if not isinstance(model, str):
            raise ClientRequestError(400, "model must be a string", code="invalid_model")
        backends = self._registry.all()
        listed = any(b.models is not None and model in b.models.names for b in backends)
        config = self._settings.served.get(model)
        if listed or config is not None:
            return ModelRef(
                model,
                base=self.base_of(model),
                load_on_demand=config is not None and config.load_on_demand,
            )
        if any(b.models is None for b in backends):
            return ModelRef(model, known=False)
        raise ModelNotFound(model)

    def learn(self, backend: Backend, data: list[dict[str, Any]]) -> None:
        """Take a backend's ``/v1/models`` entries (``id``, vLLM's ``parent`` for adapters)."""
        names: list[str] = []
        parents: dict[str, str] = {}
        dropped = 0
        for entry in data:
            name = entry.get("id")
            if not isinstance(name, str) or not _valid(name):
                continue
            if name not in self._learned and name not in self._settings.served:
                if len(self._learned) >= self._settings.max_learned:
                    dropped += 1
                    continue
                self._learned[name] = None
            names.append(name)
            parent = entry.get("parent")
            if isinstance(parent, str) and _valid(parent) and parent != name:
                parents[name] = parent
        if dropped:
            log.warning(
                "backend %s: %d models past models.max_learned (%d) are not routed to it",
                backend.name, dropped, self._settings.max_learned,
            )  # fmt: skip
        if backend.learn_models(tuple(names), parents):
            log.info("backend %s serves %s", backend.name, ", ".join(sorted(names)) or "nothing")


def _valid(name: str) -> bool:
    if len(name) > MODEL_NAME_MAX:
        return False
    try:
        check_model_name(name)
    except ValueError:
        return False
    return True


class ModelLearner:
    """Reads a backend's ``/v1/models`` after each good health check (``models.learn``)."""

    def __init__(self, catalog: ModelCatalog, upstream: Upstream) -> None:
        self._catalog = catalog
        self._upstream = upstream

    async def __call__(self, backend: Backend) -> None:
        headers = {"authorization": backend.auth_header} if backend.auth_header else None
        try:
            status, body = await self._upstream.get(backend.url + "/v1/models", headers)
            if status >= 400:
                log.debug("models of %s: status %d", backend.name, status)
                return
            data = orjson.loads(body).get("data")
        except Exception as exc:  # a backend's garbage must not stop health checks
            log.debug("models of %s unavailable: %r", backend.name, exc)
            return
        if isinstance(data, list):
            self._catalog.learn(backend, [m for m in data if isinstance(m, dict)])


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
