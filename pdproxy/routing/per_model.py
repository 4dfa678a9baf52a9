"""One router per model: requests are ranked by the router of the model they name.

Residency, predictions and load of one model say nothing about another's: each model gets a
KV router of its own (its own index, or its own Redis hash tag, its seed, block size and
tokenizer), built from the top-level ``router_options`` with the keys the model's
``models.served.<name>.router_options`` sets over them
(:meth:`~pdproxy.settings.routing.KvRouterSettings.over`). Hashes of two models never match because
their seeds differ: a model's seed defaults to ``<top-level seed>/model=<name>``, and two models
given the same seed are refused at start.

A LoRA adapter is a model of its own here, with its base model's options and the seed
``<base seed>/lora=<adapter>``, so a base-model prefix never counts as cached for an adapter
request (vLLM keeps the adapter in its block hashes' extra keys for the same reason). Adapter
routers follow no KV events: ``kvtier.residency`` skips events of LoRA blocks (see
``kvtier/residency/translate.py``), so they route on their own predictions and load.

Routers exist for configured models from the start and are built on first use for models the
catalog learned from backends (bounded by ``models.max_learned``); a request naming no model, or
a model the catalog does not know, goes to the default router (the top-level options, no KV
events: every backend's events belong to some model's router). Each
router registers its metrics on a registry of its own; :class:`RouterMetricsView` shows them
all on the proxy's ``/metrics``, the per-model ones with a ``model`` label.

A learned model the catalog forgets (no backend lists it any more) loses its router and its
series: :meth:`PerModelRouter.forget`, registered with ``ModelCatalog.on_forget`` by the router
factory. Registrants that announce names and leave would otherwise leave a router (its event
feeds, its background tasks) and a metric family's worth of series behind per name.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from pdproxy.errors import ConfigError
from pdproxy.routing.base import B, RequestOutcome, RouteDecision, Router, RouteRequest
from pdproxy.settings import KvRouterSettings, parse_router_options

if TYPE_CHECKING:
    from pdproxy.fleet.models import ModelCatalog
    from pdproxy.settings import ProxySettings

log = logging.getLogger(__name__)


class RouterMetricsView(Collector):
    """The routers' private registries as one: samples of per-model routers get a ``model``
    label; families of the same name are merged (Prometheus refuses a name twice)."""

    def __init__(self) -> None:
        self._sources: list[tuple[str | None, CollectorRegistry]] = []

    def add(self, model: str | None, registry: CollectorRegistry) -> None:
        self._sources.append((model, registry))

    def remove(self, model: str) -> None:
        """Stop showing ``model``'s router metrics (the catalog forgot the model)."""
        self._sources = [(m, r) for m, r in self._sources if m != model]

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for model, registry in list(self._sources):
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    labels = s.labels if model is None else {**s.labels, "model": model}
                    merged.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from families.values()


class PerModelRouter:
    """Implements :class:`pdproxy.routing.base.Router` by handing each request to its
    model's router. ``build(model)`` makes a model's router (and registers its metrics);
    ``known()`` lists the models a router may be built for on first use."""

    def __init__(
        self,
        *,
        default: Router,
        build: Callable[[str], Router],
        configured: Sequence[str],
        known: Callable[[], Sequence[str]],
        dropped: Callable[[str], None] | None = None,
    ) -> None:
        """``dropped(model)``: called as a forgotten model's router is let go (its metrics)."""
        self._default = default
        self._build = build
        self._known = known
        self._configured = frozenset(configured)
        self._dropped = dropped
        self._closing: set[asyncio.Task[None]] = set()
        """Forgotten models' routers being closed (awaited by :meth:`close`)."""
        # Configured models' routers are built now, so bad options fail at configuration time.
        self._routers: dict[str, Router] = {model: build(model) for model in configured}
        self._owners: dict[str, Router] = {}
        """Request id -> the router whose decision it is (``finished`` goes back there)."""
        self._lock = asyncio.Lock()
        self._started = False

    @property
    def routers(self) -> Mapping[str, Router]:
        """The per-model routers built so far."""
        return self._routers

    async def start(self) -> None:
        await self._default.start()
        for router in self._routers.values():
            await router.start()
        self._started = True

    def forget(self, names: tuple[str, ...]) -> None:
        """The catalog forgot ``names`` (``ModelCatalog.on_forget``: on the loop, must not
        block): their routers leave the map now and are closed in the background; requests
        already decided by one finish on it. Configured models' routers are kept."""
        for name in names:
            if name in self._configured:
                continue
            router = self._routers.pop(name, None)
            if router is None:
                continue
            if self._dropped is not None:
                self._dropped(name)
            task = asyncio.get_running_loop().create_task(
                self._close_forgotten(name, router), name=f"close router of {name}"
            )
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.info("KV router for model %r closed: no backend lists it any more", name)

    @staticmethod
    async def _close_forgotten(name: str, router: Router) -> None:
        try:
            await router.close()
        except Exception:
            log.exception("closing the router of forgotten model %r failed", name)

    async def close(self) -> None:
        closing, self._closing = list(self._closing), set()
        await asyncio.gather(*closing, return_exceptions=True)
        routers = [*self._routers.values(), self._default]
        self._routers = {}
        for router in routers:
            try:
                await router.close()
            except Exception:
                log.exception("closing a model's router failed")

    async def _router_for(self, model: object) -> Router:
        if not isinstance(model, str):
            return self._default
        router = self._routers.get(model)
        if router is not None:
            return router
        if not self._started or model not in self._known():
            return self._default
        async with self._lock:
            router = self._routers.get(model)
            if router is None:
                router = self._build(model)
                await router.start()
                self._routers[model] = router
                log.info("KV router for model %r built on first use", model)
        return router

    async def route(
        self, request: RouteRequest, producers: Sequence[B], consumers: Sequence[B]
    ) -> RouteDecision[B]:
        model = request.model if request.model is not None else request.body.get("model")
        router = await self._router_for(model)
        decision = await router.route(request, producers, consumers)
        self._owners[request.request_id] = router
        return decision

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        router = self._owners.pop(decision.request_id, None)
        if router is None:
            return
        try:
            await router.finished(decision, outcome)
        except Exception:  # finished must never raise into the request path
            log.exception("a model's router failed in finished()")


def model_router_settings(
    settings: ProxySettings, catalog: ModelCatalog, model: str
) -> KvRouterSettings:
    """The KV router settings of ``model``: the top-level ones, its base's (for an adapter),
    then the keys it sets itself; the seed derived from the model's name unless it sets one."""
    own = _own_settings(settings, model)
    base = catalog.base_of(model)
    if base is not None:
        base_settings = model_router_settings(settings, catalog, base)
        seed = f"{base_settings.model_seed}/lora={model}"
        return base_settings.over(own).model_copy(
            update={
                "model_seed": own.model_seed if "model_seed" in own.model_fields_set else seed,
                "events": {},
                "replay": {},
            }
        )
    top = parse_router_options(settings.router_options)
    merged = top.over(own)
    serving = {
        b.name
        for b in settings.backends
        if not b.models or model in b.models  # a backend with no list may serve it
    }
    seed = f"{top.model_seed}/model={model}"
    return merged.model_copy(
        update={
            "model_seed": own.model_seed if "model_seed" in own.model_fields_set else seed,
            "events": {k: v for k, v in merged.events.items() if k in serving},
            "replay": {k: v for k, v in merged.replay.items() if k in serving},
        }
    )


def _own_settings(settings: ProxySettings, model: str) -> KvRouterSettings:
    config = settings.models.served.get(model)
    return parse_router_options(config.router_options) if config is not None else KvRouterSettings()


def check_distinct_seeds(settings: ProxySettings, catalog: ModelCatalog) -> None:
    """Two models with one seed would share block hashes (and Redis keys): refused."""
    seen: dict[str, str] = {}
    for model in catalog.configured():
        seed = model_router_settings(settings, catalog, model).model_seed
        other = seen.setdefault(seed, model)
        if other != model:
            raise ConfigError(f"models {other!r} and {model!r} have the same model_seed")
