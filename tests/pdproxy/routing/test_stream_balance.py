"""Scenario: event-stream leases spread evenly over live proxy replicas.

Six worker streams; replicas join and leave (their load heartbeats make them live, as in
``SharedState``) and renew their leases as the event feeds do every renewal period: each
replica holds at most ``ceil(streams / live replicas)`` leases, every stream has exactly one
writer after each period settles, a new replica takes its share over, and the streams of one
that left are spread over the rest.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator

import pytest

from kvtier.keys import BlockHasher
from kvtier.residency.redis_client import connect
from kvtier.residency.redis_index import RedisIndex, RedisIndexSettings
from kvtier.residency.types import NodeId
from pdproxy.routing.kv.shared_load import RedisLoad
from pdproxy.routing.kv.stream_leases import StreamLeases

pytestmark = pytest.mark.redis

NODES = [NodeId(f"w{i}") for i in range(6)]
TTL_S = 30.0  # leases never expire during the test: only handovers move them


class Replica:
    def __init__(self, url: str, namespace: str, name: str) -> None:
        settings = RedisIndexSettings(url=url, namespace=namespace, deadline_s=2.0)
        self.index = RedisIndex(BlockHasher("balance-model", 4), settings)
        self._load_client = connect(url, socket_timeout_s=2, connect_timeout_s=2)
        self.load = RedisLoad(
            self._load_client,
            prefix=namespace,
            model_seed="balance-model",
            replica_ttl_s=60,
            replica=name,
        )
        self.leases = StreamLeases(self.index, name, TTL_S)
        self.name = name

    async def join(self) -> None:
        await self.load.heartbeat({})
        for node in NODES:  # subscribing takes any free lease, as EventFeeds.subscribe does
            await self.leases.take(node)

    async def renew(self) -> None:
        """One renewal period of ``EventFeeds._keep_leases``."""
        for node in NODES:
            await self.leases.take(node, len(NODES))
        await self.leases.balance(len(NODES))

    async def leave(self) -> None:
        for node in NODES:
            await self.leases.drop(node)
        await self.load.leave()

    async def close(self) -> None:
        await self.index.close()
        await self._load_client.aclose()


@pytest.fixture
async def namespace() -> AsyncIterator[str]:
    yield f"bal-{uuid.uuid4().hex[:8]}"


async def settle(replicas: list[Replica], periods: int = 3) -> None:
    for _ in range(periods):
        for r in replicas:
            await r.renew()


async def assert_balanced(url: str, namespace: str, live: list[Replica]) -> None:
    """Every stream has exactly one writer, a live replica that knows it holds it, and no
    replica holds more than its share."""
    client = connect(url, socket_timeout_s=2, connect_timeout_s=2)
    try:
        keys = live[0].index.keys
        owners = [await client.get(keys.lease(n)) for n in NODES]
    finally:
        await client.aclose()
    by_name = {r.name: r for r in live}
    for node, owner in zip(NODES, owners, strict=True):
        assert owner is not None, f"{node} has no writer"
        assert by_name[owner.decode()].leases.holds(node)
    share = math.ceil(len(NODES) / len(live))
    counts = {r.name: len(r.leases.held) for r in live}
    assert sum(counts.values()) == len(NODES)
    assert max(counts.values()) <= share, counts


async def test_leases_spread_over_live_replicas(redis_url: str, namespace: str) -> None:
    a, b, c = (Replica(redis_url, namespace, n) for n in ("a", "b", "c"))
    try:
        await a.join()
        assert a.leases.held == NODES  # alone: it writes every stream
        await a.renew()
        assert len(a.leases.held) == 6

        await b.join()  # every lease is taken: b writes nothing yet
        assert b.leases.held == []
        await settle([a, b])
        await assert_balanced(redis_url, namespace, [a, b])
        assert len(a.leases.held) == len(b.leases.held) == 3

        await c.join()
        await settle([a, b, c])
        await assert_balanced(redis_url, namespace, [a, b, c])
        assert [len(r.leases.held) for r in (a, b, c)] == [2, 2, 2]

        await b.leave()  # a clean leave frees its leases at once
        await settle([a, c])
        await assert_balanced(redis_url, namespace, [a, c])
        assert len(a.leases.held) == len(c.leases.held) == 3
    finally:
        for r in (a, b, c):
            await r.close()


async def test_a_free_lease_is_not_left_unwritten(redis_url: str, namespace: str) -> None:
    """A replica at its share leaves a free lease to the others for one renewal period, then
    takes it (the replica that was below its share is slow or gone before its heartbeat
    expired)."""
    a, b = Replica(redis_url, namespace, "a"), Replica(redis_url, namespace, "b")
    try:
        await a.join()
        await b.join()
        await settle([a, b])
        assert len(a.leases.held) == 3
        for node in b.leases.held:  # b lets its leases go and never renews again
            await b.leases.drop(node)
        for node in NODES:
            await a.leases.take(node, len(NODES))
        assert len(a.leases.held) == 3  # at its share: the free ones are left to b...
        for node in NODES:
            await a.leases.take(node, len(NODES))
        assert a.leases.held == NODES  # ...for one period only
    finally:
        await a.close()
        await b.close()
