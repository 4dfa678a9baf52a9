"""Build the KV-aware router from its settings (the router factory's ``"kv"`` branch), and the
I/O beside it: the live backend registry seen as its KV event sources, the engine-load scrape.

Memory mode (no ``index_url``): a :class:`~pdproxy.routing.kv.state.LocalState`. Redis mode
(``redis://`` or ``redis+cluster://``): a :class:`~pdproxy.routing.kv.shared_state.SharedState`
over one Redis client shared by a :class:`~kvtier.residency.redis_index.RedisIndex` and the
shared load counters. One router per model: call :func:`build_kv_router` once per model's
settings (each model's keys live under their own hash tag).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from pdproxy.routing.kv.engine_scrape import EngineLoadScraper, ScrapeTarget
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.scorers.engine_load import EngineLoadScorer
from pdproxy.routing.kv.state import LocalState, NodeLoad, RouterState
from pdproxy.routing.kv.telemetry import KvRouterMetrics
from pdproxy.settings import parse_router_options
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.tokenize.build import build_tokenizer

if TYPE_CHECKING:
    from pdproxy.fleet.backends import Backend, BackendRegistry

logger = logging.getLogger(__name__)


class EventSource(Protocol):
    """A backend as the registry holds it: its name, URL and KV event sockets."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def events_endpoint(self) -> str | None: ...

    @property
    def events_replay_endpoint(self) -> str | None:
        """Preferred to ``KvRouterSettings.replay`` for this backend."""
        ...

    @property
    def events_listen(self) -> bool:
        """Bind ``events_endpoint`` for the engine to connect (``BackendConfig.events_listen``)."""
        ...


class BackendSource(Protocol):
    def all(self) -> Sequence[EventSource]: ...


@dataclass(frozen=True, slots=True)
class EventEndpoints:
    """A backend's KV event sockets, as the KV router's event feeds follow them."""

    name: str
    url: str
    events_endpoint: str | None
    events_replay_endpoint: str | None
    events_listen: bool = False
    """The proxy binds ``events_endpoint`` and the engine connects (``events_listen``)."""


def event_endpoints(backends: Iterable[Backend], *, ranks: bool) -> list[EventEndpoints]:
    if not ranks:
        return [
            EventEndpoints(
                b.name,
                b.url,
                b.config.events_endpoint,
                b.config.events_replay_endpoint,
                b.config.events_listen,
            )
            for b in backends
        ]
    from pdproxy.fleet.dp_ranks import rank_streams

    return [
        EventEndpoints(node, b.url, endpoint, replay, b.config.events_listen)
        for b in backends
        for node, endpoint, replay in rank_streams(
            b.name, b.data_parallel_size, b.config.events_endpoint, b.config.events_replay_endpoint
        )
    ]


class RegistryEventSource:
    """The live backend registry seen as event sources (read afresh on every ``all()``); with
    ``ranks``, one source per data-parallel rank (:func:`pdproxy.fleet.dp_ranks.rank_streams`);
    with ``model``, only the backends serving it (models learned later move subscriptions)."""

    def __init__(
        self, registry: BackendRegistry, *, ranks: bool = False, model: str | None = None
    ) -> None:
        self._registry = registry
        self._ranks = ranks
        self._model = model

    def all(self) -> list[EventEndpoints]:
        backends = self._registry.all()
        if self._model is not None:
            backends = [b for b in backends if b.serves_model(self._model)]
        return event_endpoints(backends, ranks=self._ranks)


def parse_settings(options: Mapping[str, Any] | KvRouterSettings) -> KvRouterSettings:
    """``router_options`` as the KV router's settings (:func:`parse_router_options`)."""
    return parse_router_options(options)


def build_kv_router(
    settings: KvRouterSettings,
    *,
    backends: BackendSource | None = None,
    metrics_registry: CollectorRegistry | None = None,
    feed_sync_interval_s: float = 1.0,
) -> KvRouter:
    """``backends`` (the live registry) adds every backend's ``events_endpoint`` to the
    subscriptions, at start and whenever backends are added or removed later; a backend's
    ``events_replay_endpoint`` wins over ``settings.replay`` for that backend."""
    if backends is not None:
        settings = _with_backend_replay(settings, backends.all())
    hasher = BlockHasher(settings.model_seed, settings.block_size)
    first_url = next((b.url for b in backends.all()), None) if backends is not None else None
    tokenizer = build_tokenizer(settings.tokenizer, backend_url=first_url)
    metrics = KvRouterMetrics(metrics_registry)
    router = KvRouter(
        settings, state=build_state(settings, hasher, metrics), tokenizer=tokenizer, metrics=metrics
    )
    if backends is not None:
        router.add_background(lambda: _follow_backends(router, backends, feed_sync_interval_s))
        if settings.engine_load.enabled:
            router.add_background(lambda: engine_scraper(router, backends).run())
    return router


def engine_scraper(router: KvRouter, backends: BackendSource) -> EngineLoadScraper:
    """Scrapes every backend of the live registry into the engine-load scorer's readings; this
    proxy's own in-flight count comes from the router's state (shared load with Redis)."""
    state = router.state
    engine = router.scorer(EngineLoadScorer)

    async def own_in_flight(node: str) -> int:
        try:
            seen = await state.observe(None, [node])
        except Exception:  # the shared store is down: this replica's own count
            return state.local.get(node).in_flight
        return seen.loads.get(node, NodeLoad()).in_flight

    return EngineLoadScraper(
        router.settings.engine_load,
        lambda: [ScrapeTarget(b.name, b.url) for b in backends.all()],
        engine.readings,
        own_in_flight,
        on_result=engine.scraped,
    )


def build_state(
    settings: KvRouterSettings, hasher: BlockHasher, metrics: KvRouterMetrics
) -> RouterState:
    """In process without ``index_url``; else one Redis client (single node or cluster, no
    retries) shared by the residency index and the load counters, under one guard."""
    if settings.index_url is None:
        return LocalState(MemoryIndex(hasher, max_blocks_per_node=settings.max_blocks_per_node))
    from kvtier.residency.redis_client import connect
    from kvtier.residency.redis_index import RedisIndex, RedisIndexSettings
    from pdproxy.routing.kv.shared_load import RedisLoad
    from pdproxy.routing.kv.shared_state import SharedState
    from pdproxy.routing.kv.store_guard import BreakerState, StoreGuard
    from pdproxy.routing.kv.stream_leases import StreamLeases

    deadline = settings.redis_deadline_s
    client = connect(
        settings.index_url,
        socket_timeout_s=max(deadline * 10, 0.5),
        connect_timeout_s=deadline,
    )
    index_settings = RedisIndexSettings.model_validate(
        # The guard bounds the index's calls from a decision (one deadline per call).
        {
            "url": settings.index_url,
            "namespace": settings.key_prefix,
            "deadline_s": None,
            "max_blocks_per_node": settings.max_blocks_per_node,
        }
    )
    index = RedisIndex(hasher, index_settings, client=client, close_client=True)
    load = RedisLoad(
        client,
        prefix=settings.key_prefix,
        model_seed=settings.model_seed,
        replica_ttl_s=settings.replica_ttl_s,
    )

    def on_state(state: BreakerState) -> None:
        metrics.shared_state_up.set(1 if state is BreakerState.CLOSED else 0)

    guard = StoreGuard(
        deadline_s=deadline,
        failures=settings.breaker_failures,
        cooldown_s=settings.breaker_cooldown_s,
        on_state=on_state,
    )
    leases = StreamLeases(index, load.replica, settings.event_lease_ttl_s)
    return SharedState(index, load, guard, heartbeat_s=settings.replica_ttl_s / 5, leases=leases)


def _with_backend_replay(
    settings: KvRouterSettings, backends: Sequence[EventSource]
) -> KvRouterSettings:
    """``settings`` with the backends' replay endpoints over its own, so the subscriptions
    made at start use them (no resubscription on the first sync)."""
    announced = {b.name: b.events_replay_endpoint for b in backends if b.events_replay_endpoint}
    if not announced:
        return settings
    return settings.model_copy(update={"replay": {**settings.replay, **announced}})


async def _follow_backends(router: KvRouter, backends: BackendSource, interval_s: float) -> None:
    """Keep one event subscription per backend that announces an events endpoint; a backend's
    replay endpoint, when it has one, is preferred to the configured one."""
    configured = router.settings.events
    replay = router.settings.replay
    # start() subscribed these:
    current = {name: (ep, replay.get(name), False) for name, ep in configured.items()}
    while True:
        wanted = {name: (ep, replay.get(name), False) for name, ep in configured.items()}
        for b in backends.all():
            endpoint = b.events_endpoint or configured.get(b.name)
            if endpoint:
                listen = b.events_listen and endpoint == b.events_endpoint
                wanted[b.name] = (endpoint, b.events_replay_endpoint or replay.get(b.name), listen)
        for name in sorted(set(current) - set(wanted)):
            await router.feeds.unsubscribe(name)
            del current[name]
        for name, (endpoint, replay_endpoint, listen) in sorted(wanted.items()):
            if current.get(name) != (endpoint, replay_endpoint, listen):
                try:
                    await router.feeds.subscribe(name, endpoint, replay_endpoint, listen=listen)
                except Exception:
                    logger.exception("KV events: cannot follow %s at %s", name, endpoint)
                    continue
                current[name] = (endpoint, replay_endpoint, listen)
                logger.info(
                    "KV events: following %s at %s (replay %s)",
                    name, endpoint, replay_endpoint or "none",
                )  # fmt: skip
        await asyncio.sleep(interval_s)
