"""Replay replies in vLLM 0.32's exact frame layout (found against a real vLLM engine).

vLLM's ``ZmqEventPublisher._service_replay`` answers a DEALER's ``(b"", start_seq)`` with
``(b"", topic, seq, payload)`` per buffered batch and ends with ``(b"", b"", -1, b"")``; the
subscriber must replay from it, and kvtier's own publisher must answer the same way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvtier.events import EventBatch, EventPublisher, EventSubscriber
from kvtier.events.publisher import END_OF_REPLAY, seq_frame
from tests.conftest import free_port

TOPIC = b"kv-events"


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)  # a failed test must not hang on a socket it left open


def _payload(i: int) -> bytes:
    data: bytes = msgpack.packb([float(i), [], 0])
    return data


async def _serve_like_vllm(router: zmq.asyncio.Socket, buffered: range) -> None:
    """One replay request answered frame for frame as vLLM 0.32 does."""
    client, _, start = await router.recv_multipart()
    first = int.from_bytes(start, "big")
    for seq in buffered:
        if seq >= first:
            await router.send_multipart((client, b"", TOPIC, seq_frame(seq), _payload(seq)))
    await router.send_multipart((client, b"", b"", END_OF_REPLAY, b""))


async def test_subscriber_replays_from_a_vllm_replay_socket(ctx: zmq.asyncio.Context) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://vllm-live")
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://vllm-replay")
    got: list[EventBatch] = []

    async def on_batch(batch: EventBatch) -> None:
        got.append(batch)

    server = asyncio.create_task(_serve_like_vllm(router, range(3)))
    sub = EventSubscriber(
        "inproc://vllm-live", "inproc://vllm-replay", on_batch=on_batch, context=ctx
    )
    try:
        await sub.start()
        async with asyncio.timeout(5):
            await server
            while len(got) < 3:
                await asyncio.sleep(0.01)
        assert [int(b.ts) for b in got] == [0, 1, 2]
        assert sub.stats.replayed == 3
        assert sub.stats.malformed == 0
        assert sub.next_seq == 3
    finally:
        await sub.close()
        pub.close(linger=0)
        router.close(linger=0)


async def test_publisher_answers_replays_in_vllm_layout(ctx: zmq.asyncio.Context) -> None:
    publisher = EventPublisher(
        "inproc://kvtier-live", "inproc://kvtier-replay", topic="kv-events", context=ctx
    )
    await publisher.start()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for i in range(2):
            await publisher.publish(EventBatch(ts=float(i), events=()))
        dealer.connect("inproc://kvtier-replay")
        await dealer.send_multipart((b"", seq_frame(0)))
        async with asyncio.timeout(5):
            replies = [await dealer.recv_multipart() for _ in range(3)]
        assert [r[:3] for r in replies[:2]] == [[b"", TOPIC, seq_frame(i)] for i in range(2)]
        assert replies[2] == [b"", b"", END_OF_REPLAY, b""]
    finally:
        dealer.close(linger=0)
        await publisher.close()


async def test_wildcard_endpoint_binds_so_a_connecting_engine_reaches_it(
    ctx: zmq.asyncio.Context,
) -> None:
    """vLLM given a concrete address (``tcp://router:5557``) connects its PUB socket."""
    got: list[EventBatch] = []

    async def on_batch(batch: EventBatch) -> None:
        got.append(batch)

    port = free_port()
    sub = EventSubscriber(f"tcp://*:{port}", on_batch=on_batch, context=ctx)
    engine = ctx.socket(zmq.PUB)
    try:
        await sub.start()
        engine.connect(f"tcp://127.0.0.1:{port}")
        async with asyncio.timeout(20):
            seq = 0
            while not got:  # PUB drops what it sends before the connection is up
                await engine.send_multipart((TOPIC, seq_frame(seq), _payload(seq)))
                seq += 1
                await asyncio.sleep(0.02)
        assert sub.stats.malformed == 0
    finally:
        engine.close(linger=0)
        await sub.close()


async def test_a_taken_port_fails_start_and_leaks_no_socket(ctx: zmq.asyncio.Context) -> None:
    """Another process holds the port: start raises, and closing the context does not hang on
    a socket the subscriber left open."""
    port = free_port()
    squatter = ctx.socket(zmq.PUB)
    squatter.bind(f"tcp://*:{port}")

    async def on_batch(batch: EventBatch) -> None:
        raise AssertionError("nothing can arrive")

    own_ctx = zmq.asyncio.Context()
    sub = EventSubscriber(f"tcp://*:{port}", on_batch=on_batch, context=own_ctx)
    try:
        with pytest.raises(zmq.ZMQError):
            await sub.start()
        assert not sub.running
    finally:
        squatter.close(linger=0)
    await asyncio.wait_for(asyncio.to_thread(own_ctx.term), 10)  # hangs if a socket leaked
