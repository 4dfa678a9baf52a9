"""Release paths: done, release, lease expiry, consumer disconnect, producer killed.

After each, both page pools are back at their baseline reference counts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from pathlib import Path

import pytest

from kvtier.keys import OffloadKey
from kvtier.p2p.frames import BlockBatch, Fetch

from .conftest import (
    Pair,
    begin_write,
    make_keys,
    make_pair,
    producer_ctx,
    raw_session,
    rid,
    settings,
    wait_until,
    write_page,
)


def supply_warm(pair: Pair, k: str, n: int, *, start: int = 0) -> list[OffloadKey]:
    keys = make_keys(n, start=start)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys:
        write_page(pair.producer_pool, key)
    pair.tier.submit_store(keys, ctx)
    pair.tier.on_request_finished(ctx)
    return list(keys)


async def test_done_releases_and_finish_false_keeps(pair: Pair) -> None:
    k = rid(1)
    keys = supply_warm(pair, k, 6)
    first = await pair.fetch(k, keys[:3], finish=False)
    assert first.complete
    await asyncio.sleep(0.05)
    assert pair.registry.stats().held_pages == 6  # still supplied: no done yet
    second = await pair.fetch(k, keys)
    assert second.complete and second.local == 3 and len(second.fetched) == 3
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()


async def test_release_from_anyone(pair: Pair) -> None:
    k = rid(2)
    supply_warm(pair, k, 4)
    assert pair.producer_pool.stats().referenced == 4
    assert await pair.client.release("127.0.0.1", pair.port, k)
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()


async def test_lease_expiry() -> None:
    pair = await make_pair(settings(lease_s=0.2))
    try:
        supply_warm(pair, rid(3), 4)
        assert pair.registry.stats().held_pages == 4
        await wait_until(lambda: pair.registry.stats().requests == 0, timeout=3.0)
        pair.assert_baseline()
        result = await pair.fetch(rid(3), make_keys(4))
        assert result.usable == 0 and "lease expired" in (result.reason or "")
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_consumer_disconnect_mid_payload(pair: Pair) -> None:
    k = rid(4)
    keys = supply_warm(pair, k, 4)
    channel = await raw_session(pair.port)
    try:
        await channel.send_frame(Fetch(k, tuple(keys), 5000))
        header = await channel.read_frame()
        assert isinstance(header, BlockBatch)
        half = memoryview(bytearray(header.blocks[0].nbytes // 2))
        await asyncio.get_running_loop().sock_recv_into(channel.sock, half)
    finally:
        channel.close()  # gone in the middle of a payload, without done
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()
    assert pair.server.active_connections == 0


async def test_consumer_cancelled_while_producer_computes(pair: Pair) -> None:
    k, keys = rid(5), make_keys(6)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys[:3]:
        write_page(pair.producer_pool, key)
    pair.tier.submit_store(keys[:3], ctx)
    for key in keys[3:]:
        begin_write(pair.producer_pool, key)
    pair.tier.on_store_pending(keys[3:], ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys, timeout=30.0))
    await wait_until(lambda: pair.consumer_pool.stats().readable == 3)
    fetch.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await fetch
    await wait_until(lambda: pair.registry.stats().requests == 0)
    for key in keys[3:]:  # the producer's writes finish after the consumer left
        pair.producer_pool.complete_write(key, True)
        pair.tier.submit_store([key], ctx)
    pair.tier.on_request_finished(ctx)
    pair.assert_baseline()


async def test_producer_killed_mid_transfer() -> None:
    pair = await make_pair()
    try:
        k, keys = rid(6), make_keys(6)
        ctx = producer_ctx(k)
        pair.tier.on_new_request(ctx)
        for key in keys[:2]:
            write_page(pair.producer_pool, key)
        pair.tier.submit_store(keys[:2], ctx)
        t0 = time.monotonic()
        fetch = asyncio.create_task(pair.fetch(k, keys, timeout=10.0))
        await wait_until(lambda: pair.consumer_pool.stats().readable == 2)
        await pair.server.stop()  # the producer dies while the consumer waits for key 2
        result = await fetch
        assert time.monotonic() - t0 < 2.0
        assert result.usable == 2 and result.reason is not None
        pair.tier.on_request_finished(ctx)
        pair.assert_baseline()
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_stuck_producer_deadline_holds() -> None:
    """A producer that accepts and then says nothing: the consumer returns by its deadline."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.setblocking(False)
    accepted: list[socket.socket] = []

    async def accept() -> None:
        sock, _ = await loop.sock_accept(listener)
        accepted.append(sock)

    acceptor = asyncio.create_task(accept())
    pair = await make_pair()
    try:
        t0 = time.monotonic()
        result = await pair.client.fetch(
            "127.0.0.1", listener.getsockname()[1], rid(7), make_keys(2), time.monotonic() + 0.3
        )
        elapsed = time.monotonic() - t0
        assert result.usable == 0 and result.reason is not None
        assert elapsed < 1.0
        pair.assert_baseline()
    finally:
        acceptor.cancel()
        for sock in accepted:
            sock.close()
        listener.close()
        await pair.client.close()
        await pair.server.stop()


async def test_release_during_send_defers_the_page_release(pair: Pair) -> None:
    """A page being sent keeps its reference until its send ends (I5)."""
    k = rid(8)
    keys = supply_warm(pair, k, 2)
    holds = []
    loop = asyncio.get_running_loop()
    hold = await pair.registry.acquire(k, keys[0], loop.time() + 1, loop.time() + 1)
    assert not isinstance(hold, str)
    holds.append(hold)
    pair.registry.release(k, "test")
    assert pair.producer_pool.refcount(keys[0]) == 1  # still pinned by the send
    assert pair.producer_pool.refcount(keys[1]) == 0
    hold.close()
    hold.close()  # idempotent
    pair.assert_baseline()


async def test_consumer_that_stops_reading_is_cut_off(pair: Pair) -> None:
    k = rid(9)
    keys = supply_warm(pair, k, 1)
    channel = await raw_session(pair.port)
    try:
        # 2,000 sends of one 8 KiB page: far more than the socket buffers hold; never read.
        await channel.send_frame(Fetch(k, tuple(keys) * 2000, 200))
        await wait_until(lambda: pair.server.active_connections == 0, timeout=5.0)
    finally:
        channel.close()
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()


@pytest.mark.slow
async def test_producer_process_killed_mid_transfer() -> None:
    """A real producer process is SIGKILLed while the consumer waits for its parked keys."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.kvtier.p2p.producer_proc",
        "killed",
        "3",
        "3",
        stdout=asyncio.subprocess.PIPE,
        cwd=str(Path(__file__).resolve().parents[3]),
    )
    pair = await make_pair()
    try:
        assert proc.stdout is not None
        port = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        t0 = time.monotonic()
        fetch = asyncio.create_task(
            pair.client.fetch("127.0.0.1", port, "killed", make_keys(6), time.monotonic() + 20)
        )
        await wait_until(lambda: pair.consumer_pool.stats().readable == 3, timeout=10)
        proc.kill()
        result = await fetch
        assert time.monotonic() - t0 < 10  # well before the 20 s deadline
        assert result.usable == 3 and result.reason is not None
        pair.assert_baseline()
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        await pair.client.close()
        await pair.server.stop()
