"""A publisher cannot make a subscriber read a message of any size (issue 30, 5).

Whoever publishes a node's events (a compromised or buggy engine, or anyone who reaches a
subscriber that binds) used to be read whatever it sent: one 256 MiB message took a proxy
502 MiB at peak. Now both of a subscriber's sockets (SUB, and the DEALER of each replay) refuse
messages over ``max_message_bytes`` (libzmq ``ZMQ_MAXMSGSIZE``: the connection that carries one
is dropped before the message is read, and reconnects), counted in the subscriber's
``disconnects`` (live) and ``replay_timeouts`` (replay: its answer never completes). The batches
around it still arrive, and losing the big one is a loss like any other: reset, then follow.
"""

from __future__ import annotations

import asyncio

from kvtier.events import BlockRemoved, BlockStored, EventBatch, EventPublisher, EventSubscriber
from kvtier.events.codec import encode_batch
from kvtier.events.subscriber import DEFAULT_MAX_MESSAGE_BYTES

from .test_pubsub import Sink, batch, prime, until

BIG_TS = -1.0


def _big_batch(nbytes: int) -> EventBatch:
    """A valid batch of about ``nbytes`` encoded: one BlockStored with that many token bytes."""
    block = 16
    tokens = nbytes // 5 // block * block  # ids past 2**16 take 5 bytes each in msgpack
    event = BlockStored(
        block_hashes=tuple(range(1, tokens // block + 1)),
        parent_block_hash=None,
        token_ids=tuple(range(1 << 16, (1 << 16) + tokens)),
        block_size=block,
        lora_id=None,
        medium="GPU",
    )
    return EventBatch(ts=BIG_TS, events=(event,))


async def test_an_oversized_batch_is_never_read_live_or_replayed() -> None:
    big = _big_batch(2 * DEFAULT_MAX_MESSAGE_BYTES)
    assert len(encode_batch(big)) > DEFAULT_MAX_MESSAGE_BYTES
    sink = Sink()
    async with (
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        EventSubscriber(
            pub.endpoint,
            pub.replay_endpoint,
            on_batch=sink.on_batch,
            on_reset=sink.on_reset,
            replay_timeout_s=0.5,
        ) as sub,
    ):
        await until(lambda: pub.replays_served >= 1)  # start-up catch-up done
        n = await prime(pub, sub)
        await until(lambda: len(sink.batches) == n)
        big_seq = await pub.publish(big)  # live, and in the publisher's replay buffer
        # Later batches still arrive: the subscriber reconnects, finds the big one missing,
        # cannot replay it either, resets and follows the stream again.
        i = n
        async with asyncio.timeout(20):
            while not any(int(b.ts) > n for b in sink.batches):
                await pub.publish(batch(i + 1))
                i += 1
                await asyncio.sleep(0.05)
        assert all(b.ts != BIG_TS for b in sink.batches)
        assert sub.stats.disconnects >= 1, sub.stats  # the live copy cost its connection
        assert sub.stats.replay_timeouts >= 1, sub.stats  # so did the replayed one
        assert sub.stats.resets >= 1 and sub.next_seq > big_seq
        assert sub.running


async def test_a_batch_within_the_cap_is_delivered() -> None:
    """Control: the cap is the only difference; a batch under it arrives whole."""
    sink = Sink()
    under = _big_batch(DEFAULT_MAX_MESSAGE_BYTES // 2)
    async with (
        EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub,
        EventSubscriber(pub.endpoint, pub.replay_endpoint, on_batch=sink.on_batch) as sub,
    ):
        await until(lambda: pub.replays_served >= 1)
        n = await prime(pub, sub)
        await pub.publish(under)
        await until(lambda: len(sink.batches) == n + 1)
        assert sink.batches[-1] == under
        assert sub.stats.disconnects == 0 and sub.stats.replay_timeouts == 0


async def test_the_cap_is_the_callers_to_choose() -> None:
    sink = Sink()
    async with (
        EventPublisher("tcp://127.0.0.1:*") as pub,
        EventSubscriber(pub.endpoint, on_batch=sink.on_batch, max_message_bytes=4096) as sub,
    ):
        n = await prime(pub, sub)
        await pub.publish(EventBatch(ts=BIG_TS, events=(BlockRemoved(tuple(range(2000)), "GPU"),)))
        i = n
        async with asyncio.timeout(20):
            while not any(int(b.ts) > n for b in sink.batches):
                await pub.publish(batch(i + 1))
                i += 1
                await asyncio.sleep(0.05)
        assert all(b.ts != BIG_TS for b in sink.batches) and sub.stats.disconnects >= 1


def test_a_publisher_leaving_with_batches_queued_does_not_abort_the_subscriber() -> None:
    """A publisher sends large batches to a slower subscriber and exits. The subscriber's
    reconnect (disconnect, connect) ran while messages were still queued, and libzmq aborted
    the whole process (``Assertion failed: !_more (src/fq.cpp:80)``). Run in a child process,
    so that an abort fails this test instead of killing the test run."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import asyncio, subprocess, sys
        from kvtier.events import EventSubscriber

        async def main():
            pub = subprocess.Popen(
                [sys.executable, "-m", "tests.kvtier.events.flood_publisher"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            endpoint = pub.stdout.readline().strip()
            got = []

            async def on_batch(b):
                got.append(b)
                await asyncio.sleep(0.3)  # slower than the publisher

            sub = EventSubscriber(endpoint, on_batch=on_batch)
            await sub.start()
            await asyncio.sleep(0.3)
            pub.stdin.write("go\\n")
            pub.stdin.flush()
            await asyncio.to_thread(pub.stdout.readline)  # done
            pub.stdin.close()  # the publisher exits
            pub.wait()
            await asyncio.sleep(2.0)  # the drop is noticed with batches still queued
            await sub.close()
            print("delivered", len(got), "disconnects", sub.stats.disconnects)

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "disconnects 1" in done.stdout, done.stdout
