"""Authentication, layout fingerprint and version refusal; the loopback-only rule."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import pytest

from kvtier.errors import HandshakeRefused
from kvtier.keys import OffloadKey
from kvtier.p2p.channel import FrameChannel, is_loopback, tune_socket
from kvtier.p2p.frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    WRAPPED_PAGE_KEY_BYTES,
    Auth,
    Hello,
    PeerNodeId,
    Refuse,
    Welcome,
)
from kvtier.p2p.handshake import LocalIdentity, client_handshake

from .conftest import (
    CONSUMER,
    FINGERPRINT,
    Pair,
    make_keys,
    make_pair,
    producer_ctx,
    rid,
    settings,
    wait_until,
    write_page,
)


def supply(pair: Pair, k: str, n: int = 3) -> list[OffloadKey]:
    keys = make_keys(n)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys:
        write_page(pair.producer_pool, key)
    pair.tier.submit_store(keys, ctx)
    pair.tier.on_request_finished(ctx)
    return list(keys)


async def close(pair: Pair) -> None:
    await pair.client.close()
    await pair.server.stop()


async def test_shared_secret_authenticates_both_ways() -> None:
    pair = await make_pair(server_secret=b"s3cret", client_secret=b"s3cret")
    try:
        keys = supply(pair, rid(1))
        result = await pair.fetch(rid(1), keys)
        assert result.complete
        await wait_until(lambda: pair.registry.stats().requests == 0)
        pair.assert_baseline()
    finally:
        await close(pair)


@pytest.mark.parametrize(
    ("server_secret", "client_secret", "reason"),
    [
        (b"right", b"wrong", "authentication failed"),
        (b"right", None, "server requires the shared secret"),
        (None, b"right", "server does not authenticate"),
    ],
)
async def test_authentication_refusals(
    server_secret: bytes | None,
    client_secret: bytes | None,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pair = await make_pair(server_secret=server_secret, client_secret=client_secret)
    try:
        keys = supply(pair, rid(2))
        result = await pair.fetch(rid(2), keys)
        assert result.usable == 0 and result.fetched == ()
        assert result.reason is not None and reason in result.reason
        assert any(reason in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
        await wait_until(lambda: pair.server.active_connections == 0)
        assert pair.registry.stats().held_pages == 3  # nothing was served, nothing released
        assert pair.consumer_pool.stats().readable == 0
    finally:
        await close(pair)


@pytest.mark.parametrize(
    "change",
    [
        {"hash_seed": "other-model"},
        {"block_size": 16},
        {"dtype": "bfloat16"},
        {"page_bytes": (8192,)},
    ],
)
async def test_fingerprint_mismatch_is_refused_with_reason(change: dict[str, object]) -> None:
    other = dataclasses.replace(FINGERPRINT, **change)  # type: ignore[arg-type]
    pair = await make_pair(client_fingerprint=other)
    try:
        keys = supply(pair, rid(3))
        result = await pair.fetch(rid(3), keys)
        field = next(iter(change))
        assert result.usable == 0
        assert result.reason is not None and f"fingerprint mismatch: {field}" in result.reason
        await wait_until(lambda: pair.server.refused_total == 1)
    finally:
        await close(pair)


async def _raw_connect(port: int) -> FrameChannel:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    tune_socket(sock, 0)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    return FrameChannel(sock, 1 << 20)


async def test_version_mismatch_is_refused(pair: Pair) -> None:
    channel = await _raw_connect(pair.port)
    try:
        hello = await channel.read_frame()
        assert isinstance(hello, Hello) and not hello.auth
        await channel.send_frame(
            Auth(99, PeerNodeId("x"), FINGERPRINT, b"\x00" * NONCE_BYTES, b"\x00" * 32)
        )
        answer = await channel.read_frame()
        assert isinstance(answer, Refuse) and "protocol version 99" in answer.reason
        assert await channel.read_frame() is None  # and the server closed
    finally:
        channel.close()


async def test_server_proof_is_checked_by_the_client() -> None:
    """A server that knows no secret cannot pass as one that does."""
    loop = asyncio.get_running_loop()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)

    async def impostor() -> None:
        sock, _ = await loop.sock_accept(listener)
        tune_socket(sock, 0)
        channel = FrameChannel(sock, 1 << 20)
        try:
            nonce = b"\x01" * NONCE_BYTES
            await channel.send_frame(
                Hello(PROTOCOL_VERSION, PeerNodeId("evil"), FINGERPRINT, nonce, True)
            )
            await channel.read_frame()
            await channel.send_frame(Welcome(b"\x00" * 32, b"\x00" * WRAPPED_PAGE_KEY_BYTES))
            await channel.read_frame()
        finally:
            channel.close()

    task = asyncio.create_task(impostor())
    sock = socket.socket()
    tune_socket(sock, 0)
    await loop.sock_connect(sock, listener.getsockname())
    channel = FrameChannel(sock, 1 << 20)
    identity = LocalIdentity(PeerNodeId("c"), FINGERPRINT, b"secret")
    try:
        with pytest.raises(HandshakeRefused, match="server failed authentication"):
            await client_handshake(channel, identity)
    finally:
        channel.close()
        await task
        listener.close()


def _non_loopback_address() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
        address = str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


async def test_without_secret_only_loopback_peers(caplog: pytest.LogCaptureFixture) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    pair = await make_pair(settings(host="0.0.0.0"))
    try:
        assert any("non-loopback peers are refused" in r.getMessage() for r in caplog.records)
        keys = supply(pair, rid(4))
        result = await pair.client.fetch(address, pair.port, rid(4), keys)
        assert result.usable == 0 and "only loopback" in (result.reason or "")
        assert pair.server.refused_total == 1
        assert (await pair.fetch(rid(4), keys)).complete  # loopback still served
    finally:
        await close(pair)


def test_is_loopback() -> None:
    assert is_loopback(("127.0.0.1", 1))
    assert is_loopback(("127.3.2.1", 1))
    assert is_loopback(("::1", 1, 0, 0))
    assert is_loopback(("::ffff:127.0.0.1", 1, 0, 0))
    assert not is_loopback(("10.0.0.1", 1))
    assert not is_loopback(("::ffff:10.0.0.1", 1, 0, 0))
    assert not is_loopback(None)
    assert not is_loopback(("not an ip", 1))


def test_identity_from_settings() -> None:
    identity = LocalIdentity.from_settings("n", FINGERPRINT, settings(secret="abc"))
    assert identity.secret == b"abc"
    assert LocalIdentity.from_settings("n", FINGERPRINT, settings()).secret is None
    assert CONSUMER.secret is None
