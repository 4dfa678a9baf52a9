"""Load counters shared through a real Redis by several replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from pdproxy.routing.kv.shared_load import RedisLoad
from pdproxy.routing.kv.state import LoadDelta, NodeLoad

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url, max_connections=256)
    try:
        yield c
    finally:
        await c.aclose()


def replica(client: aioredis.Redis, name: str, ttl_s: float = 5.0) -> RedisLoad:
    return RedisLoad(client, prefix="t", model_seed="m", replica_ttl_s=ttl_s, replica=name)


async def test_replicas_see_each_others_load(client: aioredis.Redis) -> None:
    a, b = replica(client, "a"), replica(client, "b")
    await a.heartbeat({})
    await b.heartbeat({})
    await a.add([LoadDelta("n1", 1, 500), LoadDelta("n2", 1, 0)])
    await b.add([LoadDelta("n1", 2, 100)])
    expected = {"n1": NodeLoad(3, 600), "n2": NodeLoad(1, 0), "n3": NodeLoad()}
    assert await a.read(["n1", "n2", "n3"]) == expected
    assert await b.read(["n1", "n2", "n3"]) == expected
    await a.add([LoadDelta("n1", -1, -500)])
    assert (await b.read(["n1"]))["n1"] == NodeLoad(2, 100)


async def test_concurrent_increments_are_atomic(client: aioredis.Redis) -> None:
    reps = [replica(client, f"r{i}") for i in range(4)]
    for r in reps:
        await r.heartbeat({})
    await asyncio.gather(*(r.add([LoadDelta("n", 1, 16)]) for r in reps for _ in range(50)))
    assert (await reps[0].read(["n"]))["n"] == NodeLoad(200, 3200)


async def test_dead_replica_stops_counting_and_late_replica_sees_everything(
    client: aioredis.Redis,
) -> None:
    short = replica(client, "short", ttl_s=0.2)
    await short.heartbeat({})
    await short.add([LoadDelta("n", 5, 50)])
    late = replica(client, "late")
    await late.heartbeat({})
    assert (await late.read(["n"]))["n"] == NodeLoad(5, 50)  # sees it at once
    await asyncio.sleep(0.3)  # short's heartbeat expires
    assert (await late.read(["n"]))["n"] == NodeLoad()
    await late.heartbeat({})  # prunes the dead replica's fields
    assert await client.hkeys("{t:m}:load") == []


async def test_heartbeat_rewrites_own_fields_from_local_view(client: aioredis.Redis) -> None:
    a, b = replica(client, "a"), replica(client, "b")
    await a.heartbeat({})
    await b.heartbeat({})
    await a.add([LoadDelta("n", 7, 700)])  # e.g. a release was lost while Redis was away
    await b.add([LoadDelta("n", 1, 10)])
    await a.heartbeat({"n": NodeLoad(2, 20), "m": NodeLoad(0, 0)})
    assert await a.read(["n", "m"]) == {"n": NodeLoad(3, 30), "m": NodeLoad()}
    await a.leave()
    assert await b.read(["n"]) == {"n": NodeLoad(1, 10)}
