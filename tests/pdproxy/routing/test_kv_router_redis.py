"""Several proxy replicas sharing one real Redis, and Redis failing under a running router."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from kvtier.events import EventBatch, EventPublisher
from kvtier.residency.types import NodeId
from pdproxy.routing.base import RequestOutcome
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.settings import KvRouterSettings
from pdproxy.routing.kv.store_guard import BreakerState
from tests.conftest import RedisServer
from tests.redis_cluster import redis_cluster_url

from .kv_helpers import BS, SEED, pool, prompt_text, stored, text_request

pytestmark = pytest.mark.redis
__all__ = ["redis_cluster_url"]  # the session's cluster fixture


def settings_for(url: str, **extra: object) -> KvRouterSettings:
    base = {"model_seed": SEED, "block_size": BS, "index_url": url, "redis_deadline_s": 0.05}
    return KvRouterSettings.model_validate({**base, **extra})


async def write_events(router: KvRouter, node: NodeId, batch: EventBatch) -> None:
    """Apply ``batch`` as the writer of ``node``'s stream (taking its lease first)."""
    leases = router.state.leases
    assert leases is not None
    await leases.take(node)
    assert leases.holds(node)
    await leases.apply(node, batch, seq=0)


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[[KvRouterSettings], KvRouter]]:
    routers: list[KvRouter] = []

    def make(settings: KvRouterSettings) -> KvRouter:
        r = build_kv_router(settings, metrics_registry=CollectorRegistry())
        routers.append(r)
        return r

    try:
        yield make
    finally:
        for r in routers:
            await r.close()


async def test_two_replicas_make_the_same_choice_and_share_load(
    redis_url: str, make_router: Callable[[KvRouterSettings], KvRouter]
) -> None:
    a, b = make_router(settings_for(redis_url)), make_router(settings_for(redis_url))
    await a.start()
    await b.start()
    producers, consumers = pool(3, 2)
    prefix = prompt_text(1)
    await write_events(a, NodeId("p2"), stored(prefix))  # events applied by one replica
    da = await a.route(text_request(prefix + "q1"), producers, consumers)
    assert da.explain["index"] == "redis"
    assert da.producers[0].name == "p2" and da.reason == "kv-prefix"
    # b sees a's in-flight charge on p2 and on the consumer a chose.
    db = await b.route(text_request(prompt_text(2)), producers, consumers)
    rows = {r["name"]: r for r in db.explain["producers"]}
    assert rows["p2"]["in_flight"] == 1 and rows["p0"]["in_flight"] == 0
    crow = {r["name"]: r for r in db.explain["consumers"]}
    assert crow[da.consumers[0].name]["in_flight"] == 1
    assert db.consumers[0].name != da.consumers[0].name  # load spreads across replicas
    await b.finished(db, RequestOutcome(None, db.consumers[0].name, ok=True))
    # Same state → same choice, whichever replica decides.
    same_a = await a.route(text_request(prefix + "q2"), producers, consumers)
    await a.finished(same_a, RequestOutcome(None, None, ok=False))
    same_b = await b.route(text_request(prefix + "q2"), producers, consumers)
    await b.finished(same_b, RequestOutcome(None, None, ok=False))
    assert [x.name for x in same_a.producers] == [x.name for x in same_b.producers]
    assert [x.name for x in same_a.consumers] == [x.name for x in same_b.consumers]
    # a's release is visible to b.
    await a.finished(da, RequestOutcome("p2", da.consumers[0].name, ok=True))
    after = await b.route(text_request(prompt_text(3)), producers, consumers)
    assert all(r["in_flight"] == 0 for r in after.explain["producers"])


async def test_late_replica_sees_residency_predictions_and_load_at_once(
    redis_url: str, make_router: Callable[[KvRouterSettings], KvRouter]
) -> None:
    a = make_router(settings_for(redis_url))
    await a.start()
    producers, consumers = pool(2, 2)
    prefix = prompt_text(4)
    first = await a.route(text_request(prefix + "x"), producers, consumers)
    late = make_router(settings_for(redis_url))
    await late.start()
    d = await late.route(text_request(prefix + "y"), producers, consumers)
    # The late replica sees a's prediction on the consumer a chose and sends the sibling there.
    assert d.consumers[0].name == first.consumers[0].name
    row = next(r for r in d.explain["consumers"] if r["name"] == first.consumers[0].name)
    assert row["predicted"] == 128 and row["in_flight"] == 1


async def test_redis_killed_mid_run_falls_back_and_recovers(
    own_redis: RedisServer, make_router: Callable[[KvRouterSettings], KvRouter]
) -> None:
    always_pd = {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}
    router = make_router(
        settings_for(own_redis.url, breaker_cooldown_s=0.2, local_prefill=always_pd)
    )
    await router.start()
    producers, consumers = pool(2, 2)
    prefix = prompt_text(5)
    await write_events(router, NodeId("p1"), stored(prefix))
    sources: list[str] = []
    slowest_after_kill = 0.0
    killed_at: float | None = None
    first_fallback_at: float | None = None
    for i in range(60):
        if i == 20:
            own_redis.stop()
            killed_at = time.perf_counter()
        t0 = time.perf_counter()
        d = await router.route(text_request(prefix + str(i)), producers, consumers)
        t1 = time.perf_counter()
        await router.finished(d, RequestOutcome(None, d.consumers[0].name, ok=True))
        sources.append(d.explain["index"])
        if killed_at is not None:
            slowest_after_kill = max(slowest_after_kill, t1 - t0)
            if first_fallback_at is None and d.explain["index"] == "fallback":
                first_fallback_at = t1
        await asyncio.sleep(0.005)
    # Before the kill: the shared index (a rare call past its 50 ms deadline on a busy machine
    # falls back for that one request, by design).
    assert sources[:20].count("redis") >= 15, sources
    assert set(sources[20:]) == {"fallback"}
    assert killed_at is not None and first_fallback_at is not None
    assert first_fallback_at - killed_at < 0.1
    assert slowest_after_kill < 0.1
    assert router.breaker_state is BreakerState.OPEN
    gauge = router.metrics.registry.get_sample_value("pdproxy_kv_router_shared_state_up")
    assert gauge == 0
    # Redis returns (empty: no persistence). Routing recovers by itself.
    own_redis.start()
    deadline = time.monotonic() + 5
    d = None
    while time.monotonic() < deadline:
        d = await router.route(text_request(prefix + "back"), producers, consumers)
        await router.finished(d, RequestOutcome(None, None, ok=False))
        if d.explain["index"] == "redis":
            break
        await asyncio.sleep(0.05)
    assert d is not None and d.explain["index"] == "redis"
    assert router.breaker_state is BreakerState.CLOSED
    assert router.metrics.registry.get_sample_value("pdproxy_kv_router_shared_state_up") == 1
    # Residency rebuilt from events after the restart.
    await write_events(router, NodeId("p1"), stored(prefix))
    d = await router.route(text_request(prefix + "again"), producers, consumers)
    assert d.producers[0].name == "p1" and d.reason == "kv-prefix"


async def test_paused_redis_costs_a_deadline_not_a_hang(
    own_redis: RedisServer, make_router: Callable[[KvRouterSettings], KvRouter]
) -> None:
    router = make_router(settings_for(own_redis.url, breaker_cooldown_s=10))
    await router.start()
    producers, consumers = pool(2, 2)
    own_redis.pause()
    try:
        times = []
        for i in range(6):
            t0 = time.perf_counter()
            d = await router.route(text_request(prompt_text(6) + str(i)), producers, consumers)
            times.append(time.perf_counter() - t0)
            assert d.explain["index"] == "fallback"
            await router.finished(d, RequestOutcome(None, None, ok=False))
    finally:
        own_redis.resume()
    assert max(times) < 0.25  # one deadline (50 ms) per call at most
    # After three failures the breaker is open: no more waiting at all.
    assert router.breaker_state is BreakerState.OPEN
    assert max(times[3:]) < 0.02


async def test_late_replica_joining_events_keeps_the_shared_state(
    redis_url: str, make_router: Callable[[KvRouterSettings], KvRouter]
) -> None:
    prefix = prompt_text(7)
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2) as pub:
        feeds = {"events": {"p1": pub.endpoint}, "replay": {"p1": pub.replay_endpoint}}
        early = make_router(settings_for(redis_url, **feeds))
        await early.start()
        producers, consumers = pool(2, 1)
        hashes = early.hasher.hash_tokens(list(prefix.encode()))
        deadline = time.monotonic() + 5
        while NodeId("p1") not in await early.state.index.match(hashes):
            assert time.monotonic() < deadline, "events never arrived"
            await pub.publish(stored(prefix))  # PUB/SUB joins late: republish until applied
            await asyncio.sleep(0.05)
        for i in range(4):  # the replay buffer moves past what a late subscriber could replay
            await pub.publish(stored(prompt_text(50 + i)))
        late = make_router(settings_for(redis_url, **feeds))
        await late.start()
        sub = late.feeds.subscriber("p1")
        assert sub is not None
        deadline = time.monotonic() + 5
        while sub.stats.resets == 0 or sub.stats.delivered == 0:  # reset handled, replay applied
            assert time.monotonic() < deadline, "the late subscriber never saw the gap"
            await asyncio.sleep(0.02)
        d = await late.route(text_request(prefix + "?"), producers, consumers)
        assert d.producers[0].name == "p1" and d.reason == "kv-prefix"


async def test_two_replicas_share_state_over_a_redis_cluster(
    redis_cluster_url: str, make_router: Callable[[KvRouterSettings], KvRouter]
) -> None:
    """The same sharing over a real 3-master Redis Cluster (``redis+cluster://``)."""
    # A generous deadline: a cluster client discovers the slots on its first call.
    cluster = settings_for(redis_cluster_url, model_seed="clu}ster{", redis_deadline_s=1.0)
    a, b = make_router(cluster), make_router(cluster)
    await a.start()
    await b.start()
    producers, consumers = pool(3, 2)
    prefix = prompt_text(11)
    await write_events(a, NodeId("p2"), stored(prefix, seed="clu}ster{"))
    da = await a.route(text_request(prefix + "q1"), producers, consumers)
    assert da.explain["index"] == "redis"
    assert da.producers[0].name == "p2" and da.reason == "kv-prefix"
    # b sees a's residency and prediction, and a's load.
    hashes = b.hasher.hash_tokens(list(prefix.encode()))
    seen = await b.state.observe(hashes, ["p2", da.consumers[0].name])
    assert seen.source == "redis" and seen.matches is not None
    assert seen.matches[NodeId("p2")].total == len(prefix) // BS
    assert seen.matches[NodeId(da.consumers[0].name)].predicted == len(prefix) // BS
    assert seen.loads["p2"].in_flight == 1
    db = await b.route(text_request(prefix + "q2"), producers, consumers)
    assert db.explain["index"] == "redis"
    await a.finished(da, RequestOutcome(None, None, ok=True))
    await b.finished(db, RequestOutcome(None, None, ok=True))
