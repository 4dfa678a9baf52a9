"""Which models the proxy knows, what a request's ``model`` resolves to, and learning models
from backends.

A model is *configured* when the operator names it (``models.served``, the ``models`` of a
backend in the config) and *learned* when a backend lists it: its ``/v1/models`` (vLLM lists
loaded LoRA adapters there too, with their base model as ``parent``), or the ``models`` of a
backend that joined later (a registered worker's announcement, DNS, the admin API). A request
naming a model nobody serves gets OpenAI's 404 ``model_not_found``, unless a backend whose list
is not known yet could serve it.

Metric labels, per-model routers and per-model admission buckets exist only for known models,
so they are bounded by the catalog, never by clients or backends:

- at most ``models.max_learned`` learned names in all, at most ``models.max_learned_per_backend``
  of them from one backend (one backend listing junk cannot crowd out another's new adapter);
  a backend's names past either budget are not routed to it when learned from ``/v1/models``,
  and get the ``other`` label when they come with its config;
- a learned name that no backend lists any more is *forgotten*: it leaves :meth:`known`, and
  every callback given to :meth:`ModelCatalog.on_forget` hears of it, so that what was built for
  it (a router, an admission bucket, metric series) can be dropped. Configured names are never
  forgotten.

``GET /v1/models``: the union of the model lists of all routable backends, cached briefly.

Behind the client key when keys are configured (the app checks it). Without the cache every
call would fan out to every backend: a cheap way to load them all. One fan-out at a time serves
every caller that arrives while it runs; its answer is reused for ``cache_s``.

A backend's ``/v1/models`` answer is untrusted input: one larger than ``models.max_list_bytes``
is read no further than that (the connection is dropped, not reused) and not parsed; a large
one is parsed on a worker thread, not on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.errors import ClientRequestError, ModelNotFound, ResponseTooLarge
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.settings.models import MODEL_NAME_MAX, ModelsSettings, check_model_name
from pdproxy.upstream.client import Upstream

log = logging.getLogger(__name__)

OTHER_LABEL = "other"
"""The metric label of a request whose model is not known (served by a backend with no list,
or past the learned budgets)."""
DEFAULT_MAX_LIST_BYTES = ModelsSettings.model_fields["max_list_bytes"].default
_INLINE_PARSE_BYTES = 64 * 1024
"""Answers up to this size are parsed on the loop (well under a millisecond); larger ones on a
worker thread."""

ForgetCallback = Callable[[tuple[str, ...]], None]


@dataclass(frozen=True, slots=True)
class ModelRef:
    """What a request's ``model`` resolved to."""

    name: str
    base: str | None = None
    """Its base model when it is a LoRA adapter."""
    known: bool = True
    """False: not a known model (no backend lists it but backends whose list is unknown may
    serve it, or it is past the learned budgets): it gets the ``other`` label."""
    load_on_demand: bool = False

    @property
    def label(self) -> str:
        return self.name if self.known else OTHER_LABEL


class ModelCatalog:
    """The known models. Runs on the event loop only; :meth:`resolve` is on every request.

    The backends in the registry when the catalog is made are the configured ones: their
    ``models`` are configured names. Whatever changes the registry later (membership, the
    admin API) moves ``BackendRegistry.version``: the learned names are recounted on the next
    read (:meth:`known`, :meth:`resolve`, :meth:`learn`)."""

    def __init__(self, settings: ModelsSettings, registry: BackendRegistry) -> None:
        self._settings = settings
        self._registry = registry
        names = dict.fromkeys(settings.served)
        for backend in registry.all():
            names.update(dict.fromkeys(backend.config.models))
        self._configured = tuple(names)
        self._configured_set = frozenset(names)
        self._learned: dict[str, None] = {}
        """Names learned from backends, in the order first seen (bounded)."""
        self._version = registry.version
        self._on_forget: list[ForgetCallback] = []

    @property
    def settings(self) -> ModelsSettings:
        return self._settings

    def configured(self) -> list[str]:
        """Models named in the configuration (``models.served`` and the configured backends'
        ``models``); never forgotten."""
        return list(self._configured)

    def known(self) -> list[str]:
        """The configured models, then the learned ones still listed by some backend."""
        self._refresh()
        return [*self._configured, *self._learned]

    def on_forget(self, callback: ForgetCallback) -> None:
        """Call ``callback(names)`` with the learned names no backend lists any more, each time
        some are forgotten. Called on the event loop, synchronously from whichever read
        noticed (often :meth:`resolve`, on a request's path): it must not block or raise; it
        may schedule work (closing a router) but not await it."""
        self._on_forget.append(callback)

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
        self._refresh()
        backends = self._registry.all()
        listed = any(b.models is not None and model in b.models.names for b in backends)
        config = self._settings.served.get(model)
        if listed or config is not None:
            known = model in self._configured_set or model in self._learned
            return ModelRef(
                model,
                base=self.base_of(model),
                known=known,
                load_on_demand=config is not None and config.load_on_demand,
            )
        if any(b.models is None for b in backends):
            return ModelRef(model, known=False)
        raise ModelNotFound(model)

    def learn(self, backend: Backend, data: list[dict[str, Any]]) -> None:
        """Take a backend's ``/v1/models`` entries (``id``, vLLM's ``parent`` for adapters).
        A backend with configured ``models`` keeps them (nothing is learned from it)."""
        if backend.config.models:
            return
        self._refresh()
        names: list[str] = []
        seen: set[str] = set()
        parents: dict[str, str] = {}
        over_backend = 0
        learned = 0
        for entry in data:
            name = entry.get("id")
            if not isinstance(name, str) or name in seen or not _valid(name):
                continue
            seen.add(name)
            if name not in self._configured_set:
                if learned >= self._settings.max_learned_per_backend:
                    over_backend += 1
                    continue
                learned += 1
            names.append(name)
            parent = entry.get("parent")
            if isinstance(parent, str) and _valid(parent) and parent != name:
                parents[name] = parent
        before = backend.models
        backend.learn_models(tuple(names), parents)
        self._recount()  # which of its new names fit the global budget
        kept = tuple(n for n in names if n in self._configured_set or n in self._learned)
        backend.learn_models(kept, parents)
        over_all = len(names) - len(kept)
        if over_backend or over_all:
            log.warning(
                "backend %s: %d models past models.max_learned_per_backend (%d) and %d past "
                "models.max_learned (%d) are not routed to it",
                backend.name, over_backend, self._settings.max_learned_per_backend, over_all,
                self._settings.max_learned,
            )  # fmt: skip
        if backend.models != before:
            log.info("backend %s serves %s", backend.name, ", ".join(sorted(kept)) or "nothing")

    def _refresh(self) -> None:
        if self._registry.version != self._version:
            self._recount()

    def _recount(self) -> None:
        """Learned names := those some backend lists now, within both budgets; earlier names
        keep their place, new ones join in backend order while there is room."""
        self._version = self._registry.version
        per_backend = self._settings.max_learned_per_backend
        listed: dict[str, None] = {}
        for backend in self._registry.all():
            if backend.models is None:
                continue
            own = [n for n in backend.models.listed if n not in self._configured_set]
            listed.update(dict.fromkeys(own[:per_backend]))
        kept = {name: None for name in self._learned if name in listed}
        for name in listed:
            if len(kept) >= self._settings.max_learned:
                break
            kept.setdefault(name, None)
        forgotten = tuple(name for name in self._learned if name not in kept)
        self._learned = kept
        if forgotten:
            log.info("models no backend lists any more: %s", ", ".join(forgotten[:20]))
            for callback in self._on_forget:
                try:
                    callback(forgotten)
                except Exception:  # a watcher's bug must not fail the request that noticed
                    log.exception("a model catalog watcher failed")


def _valid(name: str) -> bool:
    if len(name) > MODEL_NAME_MAX:
        return False
    try:
        check_model_name(name)
    except ValueError:
        return False
    return True


async def read_model_list(
    upstream: Upstream, backend: Backend, max_bytes: int
) -> list[dict[str, Any]] | None:
    """A backend's ``/v1/models`` entries with a string ``id``; None when the list cannot be
    had (an error status, a failure, an answer over ``max_bytes``, not a list)."""
    headers = {"authorization": backend.auth_header} if backend.auth_header else None
    try:
        try:
            status, body = await upstream.get(
                backend.url + "/v1/models", headers, max_bytes=max_bytes
            )
        except ResponseTooLarge:
            log.warning(
                "models of %s: answer over models.max_list_bytes (%d): not read further",
                backend.name, max_bytes,
            )  # fmt: skip
            return None
        if status >= 400:
            log.debug("models of %s: status %d", backend.name, status)
            return None
        if len(body) > _INLINE_PARSE_BYTES:
            return await asyncio.to_thread(_entries, body)
        return _entries(body)
    except Exception as exc:  # a backend's garbage must not stop health checks
        log.debug("models of %s unavailable: %r", backend.name, exc)
        return None


def _entries(body: bytes) -> list[dict[str, Any]] | None:
    """Parse a ``/v1/models`` answer (may run on a worker thread: touches nothing shared)."""
    answer = orjson.loads(body)
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return None
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


class ModelLearner:
    """Reads a backend's ``/v1/models`` after each good health check (``models.learn``)."""

    def __init__(self, catalog: ModelCatalog, upstream: Upstream) -> None:
        self._catalog = catalog
        self._upstream = upstream

    async def __call__(self, backend: Backend) -> None:
        max_bytes = self._catalog.settings.max_list_bytes
        data = await read_model_list(self._upstream, backend, max_bytes)
        if data is not None:
            self._catalog.learn(backend, data)


async def _models_of(upstream: Upstream, backend: Backend, max_bytes: int) -> list[dict[str, Any]]:
    return await read_model_list(upstream, backend, max_bytes) or []


async def aggregate_models(
    registry: BackendRegistry, upstream: Upstream, max_bytes: int = DEFAULT_MAX_LIST_BYTES
) -> dict[str, Any]:
    backends = [b for b in registry.all() if b.routable]
    lists = await asyncio.gather(*(_models_of(upstream, b, max_bytes) for b in backends))
    seen: dict[str, dict[str, Any]] = {}
    for models in lists:
        for model in models:
            seen.setdefault(model["id"], model)
    return {"object": "list", "data": list(seen.values())}


class ModelList:
    """The cached, single-flight model list (each backend's answer capped at ``max_bytes``)."""

    def __init__(
        self,
        registry: BackendRegistry,
        upstream: Upstream,
        cache_s: float,
        max_bytes: int = DEFAULT_MAX_LIST_BYTES,
    ) -> None:
        self._registry = registry
        self._upstream = upstream
        self._cache_s = cache_s
        self._max_bytes = max_bytes
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
            models = await aggregate_models(self._registry, self._upstream, self._max_bytes)
            body = orjson.dumps(models)
            self._body, self._at = body, time.monotonic()
            return body
        finally:
            self._pending = None

    async def close(self) -> None:
        pending = self._pending
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
