"""A misbehaving producer can shorten the consumer's prefix, never corrupt it (I6)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from kvtier.keys import OffloadKey
from kvtier.p2p.channel import FrameChannel, tune_socket
from kvtier.p2p.client import FetchResult
from kvtier.p2p.frames import (
    LENGTH_PREFIX,
    BlockBatch,
    BlockHeader,
    Done,
    Fail,
    Fetch,
    PeerNodeId,
)
from kvtier.p2p.handshake import LocalIdentity, server_handshake
from kvtier.p2p.sealing import PageSealer

from .conftest import (
    FINGERPRINT,
    PAGE,
    Pair,
    make_keys,
    make_pair,
    payload,
    producer_ctx,
    wait_until,
    write_page,
)

Script = Callable[[FrameChannel, Fetch], Awaitable[None]]
PAGE_KEY = b"\x5a" * 32
"""The fake producer's page key (tests forge tags that verify, or not, under it)."""


async def good_block(channel: FrameChannel, key: OffloadKey) -> None:
    await channel.send_blocks([(key, memoryview(payload(key)), None)])


async def forged_block(channel: FrameChannel, header: BlockHeader, data: bytes) -> None:
    """A block whose header says what the test wants (its own MAC is valid: this producer holds
    the session key); the payload goes out raw, after it."""
    await forged_batch(channel, [header], data)


async def forged_batch(channel: FrameChannel, headers: list[BlockHeader], data: bytes) -> None:
    """One ``blocks`` frame announcing ``headers`` (session MAC valid), then ``data`` raw."""
    await channel.send_frame(BlockBatch(tuple(headers)))
    await asyncio.get_running_loop().sock_sendall(channel.sock, data)


def tagged(key: OffloadKey, page_key: bytes | None = None) -> BlockHeader:
    """A header whose tag is right for ``key``'s payload under ``page_key`` (the fake
    producer's), or a made-up tag without one."""
    if page_key is None:
        return BlockHeader(key, PAGE, b"\x01" * 16)
    tag = PageSealer(page_key).tag(payload(key))  # nonce 0 each time: fine for a test key
    return BlockHeader(key, PAGE, tag.mac, tag.nonce)


async def run_against(
    script: Script, n: int = 4, pair: Pair | None = None
) -> tuple[Pair, FetchResult]:
    """Serve one fetch of ``n`` keys with ``script``; returns the consumer pair and result."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    identity = LocalIdentity(PeerNodeId("fake-producer"), FINGERPRINT, None)

    async def serve() -> None:
        sock, _ = await loop.sock_accept(listener)
        tune_socket(sock, 0)
        channel = FrameChannel(sock, 1 << 20)
        try:
            await server_handshake(channel, identity, pages=PageSealer(PAGE_KEY))
            fetch = await channel.read_frame()
            assert isinstance(fetch, Fetch)
            await script(channel, fetch)
            await asyncio.sleep(0.05)
        finally:
            channel.close()

    server = asyncio.create_task(serve())
    pair = pair or await make_pair()
    try:
        result = await pair.client.fetch(
            "127.0.0.1", listener.getsockname()[1], "k", make_keys(n), time.monotonic() + 2
        )
        await server
    finally:
        listener.close()
        await pair.client.close()
        await pair.server.stop()
    return pair, result


async def test_payload_with_a_wrong_mac_is_not_installed() -> None:
    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        await good_block(channel, fetch.keys[0])
        await forged_block(
            channel, BlockHeader(fetch.keys[1], PAGE, b"\x01" * 16), payload(fetch.keys[1])
        )

    pair, result = await run_against(script)
    assert result.usable == 1 and "block payload failed authentication" in (result.reason or "")
    assert pair.consumer_pool.stats().readable == 1
    pair.assert_baseline()


async def test_forged_page_mid_fetch_installs_only_the_pages_before_it() -> None:
    """Pages are verified off the loop, in batches: a forged page in the middle of a longer
    fetch still ends the prefix exactly there; nothing after it becomes readable."""

    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        for key in fetch.keys[:5]:
            await good_block(channel, key)
        forged = BlockHeader(fetch.keys[5], PAGE, b"\x01" * 16)
        await forged_block(channel, forged, payload(fetch.keys[5]))
        for key in fetch.keys[6:]:
            await good_block(channel, key)

    pair, result = await run_against(script, n=12)
    assert result.usable == 5 and "block payload failed authentication" in (result.reason or "")
    assert pair.consumer_pool.stats().readable == 5
    pair.assert_baseline()


async def test_forged_page_inside_one_batch_installs_only_the_pages_before_it() -> None:
    """One ``blocks`` frame of six pages whose third payload does not match its tag: the two
    before it are installed, it and every later page of the frame (and the fetch) are not."""

    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        keys = fetch.keys[:6]
        headers = [tagged(k, PAGE_KEY) for k in keys]
        data = [payload(k) for k in keys]
        data[2] = bytes(PAGE)  # the header's tag is for the real payload
        await forged_batch(channel, headers, b"".join(data))
        await channel.send_blocks([(k, memoryview(payload(k)), None) for k in fetch.keys[6:]])

    pair, result = await run_against(script, n=8)
    assert result.usable == 2 and "block payload failed authentication" in (result.reason or "")
    assert pair.consumer_pool.stats().readable == 2
    pair.assert_baseline()


async def test_a_batch_of_good_pages_is_installed_whole() -> None:
    """The control for the test above: the same frame with honest payloads installs all."""

    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        headers = [tagged(k, PAGE_KEY) for k in fetch.keys]
        await forged_batch(channel, headers, b"".join(payload(k) for k in fetch.keys))

    pair, result = await run_against(script, n=6)
    assert result.complete, result
    assert pair.consumer_pool.stats().readable == 6
    pair.assert_baseline()


async def test_batch_truncated_mid_page_installs_the_whole_pages_before() -> None:
    """A producer that dies inside a ``blocks`` frame: the pages that arrived whole (and
    verify) are installed, the page cut in half is not."""

    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        headers = [tagged(k, PAGE_KEY) for k in fetch.keys]
        data = b"".join(payload(k) for k in fetch.keys)
        await forged_batch(channel, headers, data[: 2 * PAGE + PAGE // 2])

    pair, result = await run_against(script, n=4)
    assert result.usable == 2 and result.reason is not None
    assert pair.consumer_pool.stats().readable == 2
    pair.assert_baseline()


@pytest.mark.parametrize(
    "change",
    [
        lambda keys: [tagged(k, PAGE_KEY) for k in (keys[0], keys[2], keys[1])],  # reordered
        lambda keys: [tagged(k, PAGE_KEY) for k in (keys[0], keys[1], keys[1])],  # repeated
        lambda keys: [tagged(k, PAGE_KEY) for k in keys[:5]],  # more keys than demanded
    ],
    ids=["reordered", "repeated", "undemanded"],
)
async def test_batch_naming_other_keys_installs_nothing_of_it(
    change: Callable[[tuple[OffloadKey, ...]], list[BlockHeader]],
) -> None:
    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        await good_block(channel, fetch.keys[0])
        headers = change(fetch.keys)
        await forged_batch(channel, headers, bytes(PAGE * len(headers)))

    pair, result = await run_against(script, n=3)
    assert result.usable == 1 and "out of order" in (result.reason or "")
    assert pair.consumer_pool.stats().readable == 1
    pair.assert_baseline()


async def test_pages_found_locally_mid_batch_are_skipped_in_step() -> None:
    """Keys that turned up locally after the fetch demanded them (here: keys 1 and 3, written
    by the fake producer's script just before it answers) have their payloads read and dropped
    inside the batch; the pages around them land in the right pages and verify."""
    pair = await make_pair()

    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        for key in (fetch.keys[1], fetch.keys[3]):
            write_page(pair.consumer_pool, key)
        headers = [tagged(k, PAGE_KEY) for k in fetch.keys]
        await forged_batch(channel, headers, b"".join(payload(k) for k in fetch.keys))

    _, result = await run_against(script, n=5, pair=pair)
    assert result.complete, result
    assert set(result.found_meanwhile) == set(make_keys(5)[1:4:2])
    assert len(result.fetched) == 3
    for key in make_keys(5):
        with pair.consumer_pool.acquire(key) as ref:
            assert bytes(ref.view[:PAGE]) == payload(key)
    pair.assert_baseline()


async def test_client_closed_during_a_fetch_still_verifies_and_installs() -> None:
    """close() stops the verification thread; a fetch still streaming verifies the rest of its
    pages on the loop instead, and returns normally."""
    pair = await make_pair()

    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        for key in fetch.keys[:2]:
            await good_block(channel, key)
        await wait_until(lambda: pair.consumer_pool.stats().readable == 2)
        await pair.client.close()
        for key in fetch.keys[2:]:
            await good_block(channel, key)

    _, result = await run_against(script, n=6, pair=pair)
    assert result.complete, result
    assert pair.consumer_pool.stats().readable == 6
    pair.assert_baseline()


async def _corrupt_header(channel: FrameChannel, fetch: Fetch, **change: object) -> None:
    await good_block(channel, fetch.keys[0])
    fields = {"key": fetch.keys[1], "nbytes": PAGE, "mac": bytes(16)} | change
    await forged_block(channel, BlockHeader(**fields), bytes(PAGE))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "script",
    [
        lambda ch, f: _corrupt_header(ch, f, key=f.keys[2]),  # out of order
        lambda ch, f: _corrupt_header(ch, f, key=b"\x07" * 18),  # never demanded
        lambda ch, f: _corrupt_header(ch, f, nbytes=PAGE // 2),  # wrong size for the layout
    ],
    ids=["out-of-order", "undemanded", "wrong-size"],
)
async def test_malformed_headers_end_the_prefix(script: Script) -> None:
    pair, result = await run_against(script)
    assert result.usable == 1
    assert pair.consumer_pool.stats().readable == 1
    pair.assert_baseline()


async def test_truncated_payload() -> None:
    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        await good_block(channel, fetch.keys[0])
        data = payload(fetch.keys[1])
        await forged_block(channel, BlockHeader(fetch.keys[1], PAGE, bytes(16)), data[: PAGE // 3])

    pair, result = await run_against(script)
    assert result.usable == 1 and result.reason is not None
    pair.assert_baseline()


async def test_oversize_frame_and_bad_fail_frame() -> None:
    async def oversize(channel: FrameChannel, fetch: Fetch) -> None:
        await good_block(channel, fetch.keys[0])
        await asyncio.get_running_loop().sock_sendall(channel.sock, LENGTH_PREFIX.pack(1 << 30))

    pair, result = await run_against(oversize)
    assert result.usable == 1 and "frame length" in (result.reason or "")
    pair.assert_baseline()

    async def bad_fail(channel: FrameChannel, fetch: Fetch) -> None:
        await channel.send_frame(Fail(fetch.kv_request_id, fetch.keys[1:], "skipping one"))

    pair, result = await run_against(bad_fail)
    assert result.usable == 0 and "out of order" in (result.reason or "")
    pair.assert_baseline()


async def test_unexpected_frame_during_fetch() -> None:
    async def script(channel: FrameChannel, fetch: Fetch) -> None:
        await good_block(channel, fetch.keys[0])
        await channel.send_frame(Done(fetch.kv_request_id))

    pair, result = await run_against(script)
    assert result.usable == 1 and "unexpected Done" in (result.reason or "")
    pair.assert_baseline()


async def test_consumer_pool_exhausted_ends_the_prefix() -> None:
    pair = await make_pair(consumer_pages=2)
    try:
        keys = make_keys(5)
        ctx = producer_ctx("k")
        pair.tier.on_new_request(ctx)
        for key in keys:
            write_page(pair.producer_pool, key)
        pair.tier.submit_store(keys, ctx)
        pair.tier.on_request_finished(ctx)
        # Keep both consumer pages referenced so nothing can be evicted for the third block.
        result = await pair.fetch("k", keys[:2], finish=False)
        refs = [pair.consumer_pool.acquire(k) for k in keys[:2]]
        try:
            result = await pair.fetch("k", keys)
        finally:
            for ref in refs:
                ref.release()
        assert result.usable == 2 and "no free host page" in (result.reason or "")
        assert pair.consumer_pool.stats().refusals == 1
        await asyncio.sleep(0.05)
        pair.assert_baseline()
    finally:
        await pair.client.close()
        await pair.server.stop()
