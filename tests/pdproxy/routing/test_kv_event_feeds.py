"""KV events over real ZMQ into the router: configured endpoints, endpoints announced by the
backend registry (added and removed at run time), gap replay, lost events forgetting a node."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from kvtier.events import AllBlocksCleared, EventBatch, EventPublisher
from kvtier.residency.types import NodeId
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings

from .kv_helpers import BS, HASHER, SEED, pool, prompt_text, stored, text_request


@dataclass
class RegisteredBackend:
    name: str
    url: str
    events_endpoint: str | None
    events_replay_endpoint: str | None = None
    events_listen: bool = False


class Registry:
    def __init__(self) -> None:
        self.backends: list[RegisteredBackend] = []

    def all(self) -> list[RegisteredBackend]:
        return list(self.backends)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await check():
        if loop.time() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.02)


async def held(router: KvRouter, node: str, text: str) -> int:
    m = (await router.state.index.match(HASHER.hash_tokens(list(text.encode())))).get(NodeId(node))
    return 0 if m is None else m.total


async def publish_until(
    pub: EventPublisher, batch: EventBatch, cond: Callable[[], Awaitable[bool]]
) -> None:
    """PUB/SUB joins late: republish (idempotent stores) until the subscriber has applied it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while not await cond():
        if loop.time() > deadline:
            pytest.fail("events never arrived")
        await pub.publish(batch)
        await asyncio.sleep(0.05)


async def test_configured_and_announced_endpoints_feed_the_index() -> None:
    prefix = prompt_text(1)
    async with (
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as configured,
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as announced,
    ):
        registry = Registry()
        settings = KvRouterSettings(
            model_seed=SEED,
            block_size=BS,
            events={"p0": configured.endpoint},
            replay={"p0": configured.replay_endpoint or "", "p1": announced.replay_endpoint or ""},
        )
        router = build_kv_router(
            settings,
            backends=registry,
            metrics_registry=CollectorRegistry(),
            feed_sync_interval_s=0.05,
        )
        await router.start()
        try:
            await publish_until(configured, stored(prefix), lambda: _has(router, "p0", prefix))
            # A backend registered at run time announces its endpoint: followed within a tick.
            registry.backends.append(
                RegisteredBackend("p1", "http://127.0.0.1:9", announced.endpoint)
            )
            await eventually(lambda: _subscribed(router, "p1"))
            await publish_until(
                announced,
                stored(prefix + "x" * 64),
                lambda: _has(router, "p1", prefix + "x" * 64, 132),
            )
            producers, consumers = pool(2, 1)
            d = await router.route(text_request(prefix + "x" * 64 + "?"), producers, consumers)
            assert d.producers[0].name == "p1"
            # The engine clears its cache: the index follows.
            await announced.publish(EventBatch(0.0, (AllBlocksCleared(),)))
            await eventually(lambda: _not(_has(router, "p1", prefix)))
            # Removed from the registry: unsubscribed.
            registry.backends.clear()
            await eventually(lambda: _not(_subscribed(router, "p1")))
            assert router.feeds.nodes == ["p0"]
        finally:
            await router.close()
        assert router.feeds.nodes == []


async def _has(router: KvRouter, node: str, text: str, blocks: int = 128) -> bool:
    return await held(router, node, text) >= blocks


async def _subscribed(router: KvRouter, node: str) -> bool:
    return node in router.feeds.nodes


async def _not(value: Awaitable[bool]) -> bool:
    return not await value


async def test_replay_catches_up_and_lost_events_forget_the_node() -> None:
    a, b, c, d = (prompt_text(i) for i in (2, 3, 4, 5))
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2) as pub:
        settings = KvRouterSettings(
            model_seed=SEED,
            block_size=BS,
            events={"n": pub.endpoint},
            replay={"n": pub.replay_endpoint or ""},
        )
        router = build_kv_router(settings, metrics_registry=CollectorRegistry())
        await router.start()
        try:
            await publish_until(pub, stored(a), lambda: _has(router, "n", a))
            # Missed while not subscribed, still in the replay buffer: caught up on subscribe.
            await router.feeds.unsubscribe("n")
            await pub.publish(stored(b))
            await router.feeds.subscribe("n", pub.endpoint, pub.replay_endpoint)
            await eventually(lambda: _has(router, "n", b))
            # Missed and gone from the buffer (it keeps 2): the node's state is forgotten, then
            # rebuilt from what can still be replayed.
            await router.feeds.unsubscribe("n")
            for text in (c, d, d):
                await pub.publish(stored(text))
            await router.feeds.subscribe("n", pub.endpoint, pub.replay_endpoint)
            await eventually(lambda: _has(router, "n", d))
            assert await held(router, "n", a) == 0
            assert await held(router, "n", b) == 0
            sub = router.feeds.subscriber("n")
            assert sub is not None and sub.stats.resets == 1
        finally:
            await router.close()


async def test_a_listening_backend_is_connected_to_by_its_engine() -> None:
    """``events_listen``: the proxy binds the (loopback) endpoint and the engine's PUB socket
    connects to it, rank by rank, as vLLM's does for a concrete address (a DP vLLM can publish
    privately only so). The engine side is a raw ZMQ PUB, like vLLM's."""
    import zmq
    import zmq.asyncio

    from kvtier.events.codec import encode_batch
    from kvtier.events.publisher import seq_frame
    from tests.conftest import free_port

    prefix = prompt_text(3)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    registry = Registry()
    registry.backends.append(
        RegisteredBackend("c0", "http://127.0.0.1:9", endpoint, None, events_listen=True)
    )
    settings = KvRouterSettings(model_seed=SEED, block_size=BS)
    router = build_kv_router(
        settings, backends=registry, metrics_registry=CollectorRegistry(), feed_sync_interval_s=0.05
    )
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    await router.start()
    try:
        await eventually(lambda: _subscribed(router, "c0"))
        pub.connect(endpoint)  # the engine connects: nothing listens on its side
        seq = 0

        async def has() -> bool:
            nonlocal seq
            await pub.send_multipart((b"", seq_frame(seq), encode_batch(stored(prefix))))
            seq += 1
            return await _has(router, "c0", prefix)

        await eventually(has)
    finally:
        pub.close(linger=0)
        ctx.term()
        await router.close()


async def test_a_foreign_publisher_on_a_listening_port_cannot_claim_another_rank() -> None:
    """Attacker: anyone who reaches a listening backend's port may connect a PUB (the proxy
    cannot tell it from the engine). Batches tagged with a rank that stream is not for are
    refused, however often they are sent; the same blocks tagged with its own rank are taken,
    so the refusal is the rank check's, not a dead stream's."""
    import zmq
    import zmq.asyncio

    from kvtier.events.codec import encode_batch
    from kvtier.events.publisher import seq_frame
    from tests.conftest import free_port

    prefix = prompt_text(4)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    registry = Registry()
    registry.backends.append(
        RegisteredBackend("c0", "http://127.0.0.1:9", endpoint, None, events_listen=True)
    )
    router = build_kv_router(
        KvRouterSettings(model_seed=SEED, block_size=BS),
        backends=registry,
        metrics_registry=CollectorRegistry(),
        feed_sync_interval_s=0.05,
    )
    ctx = zmq.asyncio.Context()
    foreign = ctx.socket(zmq.PUB)
    await router.start()
    try:
        await eventually(lambda: _subscribed(router, "c0"))
        foreign.connect(endpoint)
        batch = stored(prefix)
        seq = 0

        async def send(rank: int) -> None:
            nonlocal seq
            tagged = EventBatch(batch.ts, batch.events, data_parallel_rank=rank)
            await foreign.send_multipart((b"", seq_frame(seq), encode_batch(tagged)))
            seq += 1

        for _ in range(40):  # past the slow-joiner window of a fresh PUB connection
            await send(7)
            await asyncio.sleep(0.025)
        assert await held(router, "c0", prefix) == 0

        async def own_rank_taken() -> bool:
            await send(0)
            return await _has(router, "c0", prefix)

        await eventually(own_rank_taken)
    finally:
        foreign.close(linger=0)
        ctx.term()
        await router.close()
