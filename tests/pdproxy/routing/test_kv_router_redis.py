"""Several proxy replicas sharing one real Redis, and Redis failing under a running router."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest
from redis.asyncio import Redis

from kvtier.events import EventBatch, EventPublisher
from kvtier.residency.types import NodeId
from pdproxy.routing.base import RequestOutcome
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.store_guard import BreakerState
from pdproxy.settings.routing import KvRouterSettings
from tests.conftest import RedisServer
from tests.redis_cluster import redis_cluster_url

from .kv_helpers import BS, SEED, pool, prompt_text, stored, text_request

pytestmark = pytest.mark.redis
__all__ = ["redis_cluster_url"]  # the session's cluster fixture


DEADLINE_S = 1.0
"""The Redis deadline of these tests. Where sharing is under test, a call past it only turns
into a fallback the test did not ask for (a lease not taken, "fallback" where "redis" is
asserted): a loopback round trip takes well under a millisecond, and the bound absorbs the
process being descheduled on a loaded CI machine, which went past the former 50 ms (as in the
cluster and stream-takeover tests). Where the deadline itself is under test, bounds are stated
in deadlines, so that waiting one out and not waiting at all stay a deadline apart."""


def settings_for(url: str, **extra: object) -> KvRouterSettings:
    base = {
        "model_seed": SEED,
        "block_size": BS,
        "index_url": url,
        "redis_deadline_s": DEADLINE_S,
    }
    return KvRouterSettings.model_validate({**base, **extra})


async def write_events(router: KvRouter, node: NodeId, batch: EventBatch) -> None:
    """Apply ``batch`` as the writer of ``node``'s stream (taking its lease first)."""
    leases = router.state.leases
    assert leases is not None
    await leases.take(node)
    assert leases.holds(node)
    await leases.apply(node, batch, seq=0)


async def test_two_replicas_make_the_same_choice_and_share_load(
    redis_url: str, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    a, b = router_factory(settings_for(redis_url)), router_factory(settings_for(redis_url))
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
    redis_url: str, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    a = router_factory(settings_for(redis_url))
    await a.start()
    producers, consumers = pool(2, 2)
    prefix = prompt_text(4)
    first = await a.route(text_request(prefix + "x"), producers, consumers)
    late = router_factory(settings_for(redis_url))
    await late.start()
    d = await late.route(text_request(prefix + "y"), producers, consumers)
    # The late replica sees a's prediction on the consumer a chose and sends the sibling there.
    assert d.consumers[0].name == first.consumers[0].name
    row = next(r for r in d.explain["consumers"] if r["name"] == first.consumers[0].name)
    assert row["predicted"] == 128 and row["in_flight"] == 1


async def test_redis_killed_mid_run_falls_back_and_recovers(
    own_redis: RedisServer,
    router_factory: Callable[[KvRouterSettings], KvRouter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    always_pd = {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}
    router = router_factory(
        settings_for(own_redis.url, breaker_cooldown_s=0.2, local_prefill=always_pd)
    )
    await router.start()
    producers, consumers = pool(2, 2)
    prefix = prompt_text(5)
    await write_events(router, NodeId("p1"), stored(prefix))
    n = 0

    async def decide() -> str:
        nonlocal n
        n += 1
        d = await router.route(text_request(prefix + str(n)), producers, consumers)
        await router.finished(d, RequestOutcome(None, d.consumers[0].name, ok=True))
        await asyncio.sleep(0.005)
        return str(d.explain["index"])

    before = [await decide() for _ in range(20)]
    # Before the kill: the shared index (a rare call past its deadline on a busy machine falls
    # back for that one request, by design).
    assert before.count("redis") >= 15, before
    own_redis.stop()

    def shared_state_up() -> float | None:
        return router.metrics.registry.get_sample_value("pdproxy_kv_router_shared_state_up")

    # From the kill on, every decision falls back, and the breaker opens. Failures less than a
    # deadline apart count once, so it opens after three spread over two deadlines or more.
    after: list[str] = []
    with caplog.at_level(logging.WARNING, logger="pdproxy.routing.kv.store_guard"):
        while shared_state_up() == 1:
            assert len(after) < 2_000, "the breaker never opened"
            after.append(await decide())
        after += [await decide() for _ in range(20)]
    assert set(after) == {"fallback"}, after
    # The breaker opened once, on a refusal: a killed Redis costs no deadline (asserted by the
    # failure's cause, not by a stopwatch on a loaded machine).
    [opened] = [r.getMessage() for r in caplog.records if r.name.endswith("store_guard")]
    assert "routing by load alone" in opened, opened
    assert "ConnectionError" in opened and "Timeout" not in opened, opened
    # Open, or half-open where its 0.2 s cooldown has passed and the probe is due: never closed
    # while Redis is down (the former ``is OPEN`` failed whenever the machine took 0.2 s here).
    assert router.breaker_state is not BreakerState.CLOSED
    assert shared_state_up() == 0
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


async def test_decision_reloads_scripts_redis_lost(
    own_redis: RedisServer, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    """The load read rides on the match's round trip by SHA; after Redis lost its scripts (a
    restart or failover does; SCRIPT FLUSH here) the decision loads it and still reads the
    shared state: no fallback, the first decision's charge is seen."""
    router = router_factory(settings_for(own_redis.url, redis_deadline_s=1.0))
    await router.start()
    producers, consumers = pool(2, 2)
    prefix = prompt_text(8)
    await write_events(router, NodeId("p1"), stored(prefix))
    first = await router.route(text_request(prefix + "a"), producers, consumers)
    assert first.producers[0].name == "p1"
    client = Redis.from_url(own_redis.url)
    try:
        await client.script_flush()
    finally:
        await client.aclose()
    d = await router.route(text_request(prefix + "b"), producers, consumers)
    assert d.explain["index"] == "redis"
    # The sibling follows the first request's consumer: its prediction matched, its charge read.
    assert d.consumers[0].name == first.consumers[0].name
    row = {r["name"]: r for r in d.explain["consumers"]}[first.consumers[0].name]
    assert row["predicted"] == len(prefix) // BS and row["in_flight"] == 1


async def test_paused_redis_costs_a_deadline_not_a_hang(
    own_redis: RedisServer, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    router = router_factory(settings_for(own_redis.url, breaker_cooldown_s=10))
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
    # A decision's store calls end at their deadline, never hang: two in a row at most (the
    # observation, then the charge of the choice), and the bound leaves one more deadline for
    # scheduling on a loaded machine (the former bound left 150 ms).
    assert max(times) < 3 * DEADLINE_S
    # After three failures the breaker is open: no call waits for Redis any more (one that did
    # would take a whole deadline; the former 20 ms bound failed at 29 ms under load).
    assert router.breaker_state is BreakerState.OPEN
    assert max(times[3:]) < DEADLINE_S


async def test_late_replica_joining_events_keeps_the_shared_state(
    redis_url: str, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    prefix = prompt_text(7)
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2) as pub:
        feeds = {"events": {"p1": pub.endpoint}, "replay": {"p1": pub.replay_endpoint}}
        early = router_factory(settings_for(redis_url, **feeds))
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
        late = router_factory(settings_for(redis_url, **feeds))
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
    redis_cluster_url: str, router_factory: Callable[[KvRouterSettings], KvRouter]
) -> None:
    """The same sharing over a real 3-master Redis Cluster (``redis+cluster://``)."""
    # A generous deadline: a cluster client discovers the slots on its first call.
    cluster = settings_for(redis_cluster_url, model_seed="clu}ster{", redis_deadline_s=1.0)
    a, b = router_factory(cluster), router_factory(cluster)
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
