"""Closing a subscriber must not hang, nor swallow a cancel of its caller.

Right after its publisher disconnected, libzmq sends each monitor event to a PAIR socket from
its I/O thread; once the PAIR's reader is closed that send blocks forever, holding the lock that
``disable_monitor`` and ``ctx.term`` then wait on. The old close order (cancel the monitor task,
whose ``finally`` closed the reader, then disable the monitor) hung the whole process in C, where
no Python timeout reaches — so that scenario runs in a child process that a plain wall-clock
limit can kill."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.events import EventBatch, EventSubscriber
from tests.conftest import free_port

ROUNDS = 30

_PROBE = textwrap.dedent(
    """
    import asyncio, sys
    import msgpack, zmq, zmq.asyncio
    from kvtier.events import EventSubscriber
    from kvtier.events.publisher import seq_frame
    from tests.conftest import free_port

    async def once(ctx):
        got = []

        async def on_batch(batch):
            got.append(batch)

        port = free_port()
        sub = EventSubscriber(f"tcp://*:{port}", on_batch=on_batch, context=ctx)
        engine = ctx.socket(zmq.PUB)
        await sub.start()
        engine.connect(f"tcp://127.0.0.1:{port}")
        seq = 0
        async with asyncio.timeout(20):
            while not got:
                payload = msgpack.packb([float(seq), [], 0])
                await engine.send_multipart((b"kv-events", seq_frame(seq), payload))
                seq += 1
                await asyncio.sleep(0.01)
        engine.close(linger=0)  # the disconnect event races the close below
        await sub.close()

    async def main(rounds):
        ctx = zmq.asyncio.Context()
        for _ in range(rounds):
            await once(ctx)
        ctx.destroy(linger=0)
        print("closed", rounds)

    asyncio.run(main(int(sys.argv[1])))
    """
)


def test_close_right_after_the_publisher_left_does_not_hang() -> None:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(ROUNDS)],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,  # the old order hung within a handful of rounds; a hang fails, not stalls
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["closed", str(ROUNDS)]


async def test_a_caller_cancelled_during_close_is_cancelled_and_the_close_completes() -> None:
    """close() awaits its cancelled receive tasks; a cancel of the caller landing in that wait
    must reach the caller (a feed loop stopped while it unsubscribes), not be taken for the
    receive task's own and swallowed — the loop then ran on and its stopper waited forever."""

    async def on_batch(batch: EventBatch) -> None:
        raise AssertionError("nothing is published")

    port = free_port()
    sub = EventSubscriber(f"tcp://*:{port}", on_batch=on_batch)  # binds: the port shows release
    await sub.start()
    closing = asyncio.create_task(sub.close())
    await asyncio.sleep(0)  # closing has cancelled the receive tasks and waits for them
    assert not closing.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not sub.running
    with socket.socket() as s:  # the bound SUB socket is closed and its context terminated
        s.bind(("127.0.0.1", port))
