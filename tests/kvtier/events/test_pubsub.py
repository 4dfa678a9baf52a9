"""Publisher + subscriber over real ZMQ sockets: order, replay, late start, bad input, stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvtier.events import BlockRemoved, EventBatch, EventPublisher, EventSubscriber
from kvtier.events.publisher import seq_frame

from .conftest import Keys


def batch(i: int) -> EventBatch:
    return EventBatch(ts=float(i), events=(BlockRemoved((i,), "GPU"),))


class Sink:
    """Collects delivered batches; can hold the subscriber inside its callback."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.resets = 0
        self.release = asyncio.Event()
        self.release.set()

    async def on_batch(self, b: EventBatch) -> None:
        await self.release.wait()
        self.batches.append(b)

    async def on_reset(self) -> None:
        self.resets += 1

    def ts(self) -> list[int]:
        return [int(b.ts) for b in self.batches]


WAIT_S = 5.0
"""How long a scenario waits for an outcome. Subscribers whose outcome comes from a replay get
it as their replay timeout too: a timed-out replay delivers nothing (its own test is
test_replay_timeout_resets_and_close_is_prompt), so the default 1 s bound made a machine that
stalled this process for a second (CURVE handshakes on a loaded CI box) fail these tests."""


async def until(cond: Callable[[], bool], timeout: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def prime(pub: EventPublisher, sub: EventSubscriber, first: int = 0) -> int:
    """Publish batches ``first, first+1, ...`` until one arrives live (SUB joins late)."""
    i = first
    async with asyncio.timeout(5):
        while sub.stats.received == 0:
            await pub.publish(batch(i))
            i += 1
            await asyncio.sleep(0.02)
    return i


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


async def test_live_batches_arrive_in_order(keys: Keys) -> None:
    sink = Sink()
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", **keys.pub
    ) as pub:
        assert pub.replay_endpoint is not None
        async with EventSubscriber(
            pub.endpoint, pub.replay_endpoint, topic="kv", on_batch=sink.on_batch, **keys.sub
        ) as sub:
            await until(lambda: pub.replays_served >= 1)  # start-up catch-up done
            n = await prime(pub, sub)
            for i in range(n, n + 20):
                await pub.publish(batch(i))
                await asyncio.sleep(0.001)
            await until(lambda: len(sink.batches) == n + 20)
            assert sink.ts() == list(range(n + 20))
            assert sub.stats.malformed == 0
            assert sub.next_seq == n + 20


async def test_late_subscriber_catches_up_from_replay(keys: Keys) -> None:
    sink = Sink()
    async with EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", **keys.pub) as pub:
        for i in range(30):
            await pub.publish(batch(i))
        assert pub.replay_endpoint is not None
        async with EventSubscriber(
            pub.endpoint,
            pub.replay_endpoint,
            on_batch=sink.on_batch,
            on_reset=sink.on_reset,
            replay_timeout_s=WAIT_S,
            **keys.sub,
        ) as sub:
            await until(lambda: len(sink.batches) == 30)
            n = await prime(pub, sub, first=30)
            await until(lambda: len(sink.batches) == n)
            assert sink.ts() == list(range(n))
            assert sub.stats.replayed >= 30
            assert sink.resets == 0


async def test_late_start_past_the_buffer_resets_then_continues(keys: Keys) -> None:
    sink = Sink()
    async with EventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=5, **keys.pub
    ) as pub:
        for i in range(12):
            await pub.publish(batch(i))
        assert pub.replay_endpoint is not None
        async with EventSubscriber(
            pub.endpoint,
            pub.replay_endpoint,
            on_batch=sink.on_batch,
            on_reset=sink.on_reset,
            replay_timeout_s=WAIT_S,
            **keys.sub,
        ) as sub:
            await until(lambda: len(sink.batches) == 5)
            assert sink.ts() == [7, 8, 9, 10, 11]
            assert sink.resets == 1
            assert sub.stats.resets == 1


async def test_gap_is_replayed(ctx: zmq.asyncio.Context) -> None:
    """High-water marks of 1 over inproc make a held subscriber lose live messages."""
    sink = Sink()
    pub = EventPublisher("inproc://kv-gap", "inproc://kv-gap-replay", hwm=1, context=ctx)
    sub = EventSubscriber(
        "inproc://kv-gap",
        "inproc://kv-gap-replay",
        on_batch=sink.on_batch,
        on_reset=sink.on_reset,
        rcvhwm=1,
        context=ctx,
    )
    try:
        await pub.start()
        await sub.start()
        await until(lambda: pub.replays_served >= 1)
        n = await prime(pub, sub)
        await until(lambda: len(sink.batches) == n)
        sink.release.clear()  # the subscriber now sits in its callback
        await pub.publish(batch(n))
        await until(lambda: sub.stats.received == 2)
        for i in range(n + 1, n + 40):
            await pub.publish(batch(i))
        await asyncio.sleep(0.05)
        sink.release.set()
        await asyncio.sleep(0.05)
        await pub.publish(batch(n + 40))
        await until(lambda: len(sink.batches) == n + 41)
        assert sink.ts() == list(range(n + 41))
        assert sub.stats.gaps >= 1
        assert sub.stats.replayed >= 1
        assert sink.resets == 0
    finally:
        await sub.close()
        await pub.close()


async def test_no_replay_endpoint_gap_resets(ctx: zmq.asyncio.Context) -> None:
    raw = ctx.socket(zmq.PUB)
    raw.bind("inproc://kv-raw-gap")
    sink = Sink()
    sub = EventSubscriber(
        "inproc://kv-raw-gap", on_batch=sink.on_batch, on_reset=sink.on_reset, context=ctx
    )

    def payload(i: int) -> bytes:
        data: bytes = msgpack.packb([float(i), [], None])
        return data

    try:
        await sub.start()
        await asyncio.sleep(0.05)
        for seq in (0, 1, 5, 6):
            await raw.send_multipart((b"", seq_frame(seq), payload(seq)))
        await until(lambda: len(sink.batches) == 4)
        assert sink.ts() == [0, 1, 5, 6]
        assert sub.stats.gaps == 1
        assert sink.resets == 1
    finally:
        await sub.close()
        raw.close(linger=0)


async def test_publisher_restart_resets(ctx: zmq.asyncio.Context) -> None:
    raw = ctx.socket(zmq.PUB)
    raw.bind("inproc://kv-raw-restart")
    sink = Sink()
    sub = EventSubscriber(
        "inproc://kv-raw-restart", on_batch=sink.on_batch, on_reset=sink.on_reset, context=ctx
    )
    try:
        await sub.start()
        await asyncio.sleep(0.05)
        for seq in (0, 1, 2, 0, 1):
            await raw.send_multipart((b"", seq_frame(seq), msgpack.packb([float(seq), []])))
        await until(lambda: len(sink.batches) == 5)
        assert sink.ts() == [0, 1, 2, 0, 1]
        assert sink.resets == 1
    finally:
        await sub.close()
        raw.close(linger=0)


async def test_malformed_messages_are_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    raw = ctx.socket(zmq.PUB)
    raw.bind("inproc://kv-raw-bad")
    sink = Sink()
    sub = EventSubscriber(
        "inproc://kv-raw-bad", on_batch=sink.on_batch, on_reset=sink.on_reset, context=ctx
    )
    good = msgpack.packb([1.0, [["BlockRemoved", [1], "CPU", None]], None])
    try:
        await sub.start()
        await asyncio.sleep(0.05)
        await raw.send_multipart((b"", b"\x00" * 8))  # two frames
        await raw.send_multipart((b"", b"\x00\x01", good))  # short seq frame
        await raw.send_multipart((b"", seq_frame(0), b"\xc1garbage"))  # not msgpack
        await raw.send_multipart((b"", seq_frame(1), msgpack.packb(["x", 1])))  # not a batch
        await raw.send_multipart((b"", seq_frame(2), good))
        await until(lambda: len(sink.batches) == 1)
        assert sub.stats.malformed == 4
        assert sink.batches[0].events == (BlockRemoved((1,), "CPU"),)
        assert sink.resets == 0
        assert sub.next_seq == 3
    finally:
        await sub.close()
        raw.close(linger=0)


async def test_failing_handler_is_counted_not_fatal(ctx: zmq.asyncio.Context) -> None:
    raw = ctx.socket(zmq.PUB)
    raw.bind("inproc://kv-raw-handler")
    seen: list[int] = []

    async def on_batch(b: EventBatch) -> None:
        seen.append(int(b.ts))
        if b.ts == 0:
            raise RuntimeError("index down")

    sub = EventSubscriber("inproc://kv-raw-handler", on_batch=on_batch, context=ctx)
    try:
        await sub.start()
        await asyncio.sleep(0.05)
        for seq in range(2):
            await raw.send_multipart((b"", seq_frame(seq), msgpack.packb([float(seq), []])))
        await until(lambda: len(seen) == 2)
        assert sub.stats.handler_errors == 1
    finally:
        await sub.close()
        raw.close(linger=0)


async def test_replay_timeout_resets_and_close_is_prompt(ctx: zmq.asyncio.Context) -> None:
    """A replay endpoint that never answers costs one timeout, then a reset."""
    raw = ctx.socket(zmq.PUB)
    raw.bind("inproc://kv-raw-mute")
    mute = ctx.socket(zmq.ROUTER)
    mute.bind("inproc://kv-raw-mute-replay")
    sink = Sink()
    sub = EventSubscriber(
        "inproc://kv-raw-mute",
        "inproc://kv-raw-mute-replay",
        on_batch=sink.on_batch,
        on_reset=sink.on_reset,
        replay_timeout_s=0.1,
        context=ctx,
    )
    try:
        await sub.start()
        await asyncio.sleep(0.2)  # the start-up replay times out
        await raw.send_multipart((b"", seq_frame(3), msgpack.packb([3.0, []])))
        await until(lambda: len(sink.batches) == 1, timeout=2)
        assert sink.resets == 1
        assert sub.stats.gaps == 1
    finally:
        async with asyncio.timeout(1):
            await sub.close()
        raw.close(linger=0)
        mute.close(linger=0)


async def test_close_is_idempotent_and_publish_after_close_fails() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*")
    await pub.start()
    await pub.close()
    await pub.close()
    with pytest.raises(RuntimeError):
        await pub.publish(batch(0))
    sub = EventSubscriber(pub.endpoint, on_batch=Sink().on_batch)
    states = [sub.running]
    await sub.start()
    states.append(sub.running)
    await sub.close()
    states.append(sub.running)
    assert states == [False, True, False]
    await sub.close()


async def test_restarted_publisher_whose_sequence_passed_ours_still_resets(keys: Keys) -> None:
    """A new publisher process on the same endpoints may have published more batches than the
    old one before we reconnect: its sequence is *ahead* of ours, which looks like a gap. The
    dropped connection is what gives the restart away; nothing from the old process survives."""
    sink = Sink()
    old = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", **keys.pub)
    await old.start()
    endpoint, replay = old.endpoint, old.replay_endpoint
    assert replay is not None
    sub = EventSubscriber(
        endpoint,
        replay,
        on_batch=sink.on_batch,
        on_reset=sink.on_reset,
        replay_timeout_s=WAIT_S,
        **keys.sub,
    )
    try:
        await sub.start()
        await until(lambda: old.replays_served >= 1)
        n = await prime(old, sub)  # batches 0..n-1 from the old process
        await until(lambda: len(sink.batches) == n)
        await old.close()
        new = EventPublisher(endpoint, replay, **keys.pub)
        await new.start()
        try:
            for i in range(n + 5):  # ts 100+: the new process's batches, seq 0..n+4
                await new.publish(batch(100 + i))
            # Live traffic after the subscriber has reconnected reveals the restart.
            async with asyncio.timeout(WAIT_S):
                i = n + 5
                while sink.resets == 0 or sink.ts()[-1] < 100 + i - 1:
                    await new.publish(batch(100 + i))
                    i += 1
                    await asyncio.sleep(0.05)
            after_reset = sink.ts()[n:]
            assert sink.resets >= 1
            assert all(ts >= 100 for ts in after_reset)
            assert after_reset == sorted(after_reset)
            assert 100 in after_reset  # re-read from the new publisher's replay buffer
        finally:
            await new.close()
    finally:
        await sub.close()
