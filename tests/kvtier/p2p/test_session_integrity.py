"""Attackers against an authenticated session: nothing they change or inject is installed.

The relay attack of issue 15: the consumer is made to connect to an attacker, who relays the
handshake to the real producer (both ends authenticate each other through it) and then forges
or alters pages. Before session keys, the consumer installed the forged pages. Now every frame
and payload is authenticated under a key the relay never learns: the consumer refuses them,
installs nothing, and its pool is as before. Each attack has a control through the same relay
(``relay`` mode) that is served, so the test fails if the consumer refuses everything.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from kvtier.keys import OffloadKey
from kvtier.offload.types import LookupResult
from kvtier.p2p.frames import BlockBatch, Done, Fetch

from .attacker import Mode, RelayAttacker
from .blocking_peer import BlockingPeer
from .conftest import (
    FINGERPRINT,
    Pair,
    make_keys,
    make_pair,
    payload,
    producer_ctx,
    rid,
    settings,
    wait_until,
    write_page,
)

SECRET = b"integrity-test-secret"


def supply(pair: Pair, k: str, n: int = 4, start: int = 0) -> list[OffloadKey]:
    keys = make_keys(n, start=start)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys:
        write_page(pair.producer_pool, key)
    pair.tier.submit_store(keys, ctx)
    pair.tier.on_request_finished(ctx)
    return keys


async def secret_pair() -> Pair:
    return await make_pair(server_secret=SECRET, client_secret=SECRET)


def consumer_untouched(pair: Pair, keys: list[OffloadKey]) -> None:
    pool = pair.consumer_pool
    assert all(pool.lookup(k) is LookupResult.MISS for k in keys)
    stats = pool.stats()
    assert stats.readable == 0 and stats.writing == 0 and stats.referenced == 0, stats


@pytest.mark.parametrize("mode", ["forge", "flip", "inject"])
async def test_relayed_handshake_then_tampering_installs_nothing(mode: Mode) -> None:
    pair = await secret_pair()
    try:
        keys = supply(pair, rid(1))
        async with RelayAttacker(pair.port, mode) as attacker:
            result = await pair.client.fetch(
                "127.0.0.1", attacker.port, rid(1), keys, time.monotonic() + 5
            )
            assert attacker.handshakes_relayed == 1  # the relay did get both ends to talk
            assert attacker.payloads_tampered >= 1
        assert result.usable == 0 and result.fetched == () and result.nbytes == 0
        what = "block payload" if mode != "inject" else "frame"
        assert result.reason is not None and f"{what} failed authentication" in result.reason
        consumer_untouched(pair, keys)
        # The producer keeps serving legitimate consumers (control, same supply).
        await wait_until(lambda: pair.server.active_connections == 0, timeout=3.0)
        keys = supply(pair, rid(2), start=100)
        assert (await pair.fetch(rid(2), keys)).complete
        for key in keys:
            with pair.consumer_pool.acquire(key) as ref:
                assert bytes(ref.view) == payload(key)
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_relay_that_changes_nothing_is_harmless() -> None:
    """The control for the attacks above: through the same relay, untouched bytes are served."""
    pair = await secret_pair()
    try:
        keys = supply(pair, rid(3))
        async with RelayAttacker(pair.port, "relay") as relay:
            result = await pair.client.fetch(
                "127.0.0.1", relay.port, rid(3), keys, time.monotonic() + 5
            )
            assert relay.blocks_seen == len(keys)
        assert result.complete, result
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_replayed_fetch_frame_is_refused_by_the_producer() -> None:
    pair = await secret_pair()
    try:
        keys = supply(pair, rid(4))
        async with RelayAttacker(pair.port, "replay") as attacker:
            await pair.client.fetch(
                "127.0.0.1", attacker.port, rid(4), keys, time.monotonic() + 5, finish=False
            )
            assert attacker.frames_replayed == 1
            await wait_until(lambda: pair.server.stats().integrity_failures_total == 1)
        # The producer closed that session and released what it had fetched on it.
        await wait_until(lambda: pair.registry.stats().requests == 0)
    finally:
        await pair.client.close()
        await pair.server.stop()


def _blocking_session(port: int) -> tuple[socket.socket, BlockingPeer]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    return sock, BlockingPeer(sock, FINGERPRINT, SECRET)


def _closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(3)
    try:
        while chunk := sock.recv(65536):
            del chunk
    except OSError:
        pass
    return True


@pytest.mark.parametrize("attack", ["replay", "reorder", "reflect", "drop"])
async def test_control_frames_cannot_be_replayed_reordered_reflected_or_dropped(
    attack: str,
) -> None:
    """Each with a control: the same frames in order are served on a fresh session."""
    pair = await secret_pair()
    try:
        k = rid(5)
        keys = supply(pair, k, 2)

        def run() -> None:
            sock, peer = _blocking_session(pair.port)
            try:
                fetch = peer.sealed(Fetch(k, (keys[0],), 2000))
                if attack == "replay":
                    sock.sendall(fetch + fetch)
                elif attack == "reorder":
                    done = peer.sealed(Done(k))
                    sock.sendall(done + fetch)
                elif attack == "drop":
                    peer.sealed(Fetch(k, (keys[1],), 2000))  # never sent: numbers skip one
                    sock.sendall(peer.sealed(Done(k)))
                else:  # reflect: the producer's own sealed frame, sent back to it
                    sock.sendall(fetch)
                    prefix = sock.recv(4)
                    header = prefix + sock.recv(int.from_bytes(prefix, "big"))
                    sock.sendall(header)
                assert _closed_by_server(sock)
            finally:
                sock.close()

        await asyncio.to_thread(run)
        await wait_until(lambda: pair.server.stats().integrity_failures_total == 1)
        assert pair.registry.is_open(k) is (attack not in ("replay", "reflect"))

        fresh = supply(pair, rid(55), 1, start=300)

        def control() -> None:
            sock, peer = _blocking_session(pair.port)
            try:
                peer.send(Fetch(rid(55), (fresh[0],), 2000))
                header = peer.read()
                assert isinstance(header, BlockBatch)
                assert [block.key for block in header.blocks] == [fresh[0]]
            finally:
                sock.close()

        await asyncio.to_thread(control)
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_consumer_refuses_a_producer_other_than_the_one_named() -> None:
    pair = await secret_pair()
    try:
        keys = supply(pair, rid(6))
        wrong = await pair.client.fetch(
            "127.0.0.1", pair.port, rid(6), keys, expected_node_id="producer-b", finish=False
        )
        assert wrong.usable == 0 and wrong.fetched == ()
        assert "peer is node 'producer', not the expected 'producer-b'" in (wrong.reason or "")
        consumer_untouched(pair, keys)
        right = await pair.client.fetch(
            "127.0.0.1", pair.port, rid(6), keys, expected_node_id="producer", finish=False
        )
        assert right.complete
        # A pooled session to that address is not reused for a fetch naming another node.
        again = await pair.client.fetch(
            "127.0.0.1", pair.port, rid(6), make_keys(1, start=500), expected_node_id="other"
        )
        assert again.usable == 0 and "not the expected 'other'" in (again.reason or "")
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_require_producer_id_refuses_fetches_that_name_none() -> None:
    pair = await make_pair(client_settings=settings(require_producer_id=True))
    try:
        keys = supply(pair, rid(7))
        result = await pair.fetch(rid(7), keys)
        assert result.usable == 0 and "node id is unknown" in (result.reason or "")
        assert pair.server.stats().accepted_total == 0  # not even a connection
        named = await pair.client.fetch(
            "127.0.0.1", pair.port, rid(7), keys, expected_node_id="producer"
        )
        assert named.complete
    finally:
        await pair.client.close()
        await pair.server.stop()
