"""Symmetric pull against hostile peers: offers before authentication, without the secret, to
the wrong node, oversized, flooded, interleaved with a fetch or naming groups the layout
lacks; every one is refused or closes the session, and the holder pins nothing it keeps."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.errors import ProtocolError
from kvtier.offload.pool import HostPagePool
from kvtier.p2p import LocalIdentity, P2PClient, P2PServer, SupplyRegistry
from kvtier.p2p.frames import Fetch, Offer, Offered, PeerNodeId, decode_frame, encode_body

from .conftest import FINGERPRINT, make_keys, raw_session, settings, wait_until
from .offer_peers import (
    SECRET,
    Holder,
    deadline,
    holder_closed,
    make_holder,
    make_puller,
    offer_on,
    rid,
    warm,
)


async def test_offer_before_authentication_is_refused(holder: Holder) -> None:
    """An offer frame in place of the handshake's auth: the holder allocates nothing."""
    warm(holder.pool, make_keys(2))
    reader, writer = await asyncio.open_connection("127.0.0.1", holder.port)
    try:
        await reader.readexactly(4)  # the hello's length prefix: the holder speaks first
        body = encode_body(Offer(tuple(make_keys(2))))
        writer.write(len(body).to_bytes(4, "big") + body)
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), timeout=5)  # then EOF
        assert b"offered" not in rest
    finally:
        writer.close()
    await wait_until(lambda: holder.server.stats().handshake_failures_total >= 1)
    assert holder.registry.stats().requests == 0 and holder.pool.stats().referenced == 0


async def test_offer_without_the_secret_is_refused() -> None:
    h = await make_holder(settings(), secret=SECRET)
    client, _ = make_puller(secret=b"a-different-secret-0123456789abcdef")
    try:
        keys = make_keys(2)
        warm(h.pool, keys)
        offered = await client.offer("127.0.0.1", h.port, keys, deadline=deadline())
        assert offered.num_held == 0 and "handshake refused" in (offered.reason or "")
        h.assert_baseline()
    finally:
        await client.close()
        await h.server.stop()


async def test_wrong_node_id_is_refused(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, _ = puller
    keys = make_keys(2)
    warm(holder.pool, keys)
    result = await client.pull(
        "127.0.0.1", holder.port, keys, expected_node_id="someone-else", deadline=deadline()
    )
    assert result.usable == 0 and "handshake refused" in (result.reason or "")
    holder.assert_baseline()


async def test_oversized_offer_is_refused_on_both_ends() -> None:
    h = await make_holder(settings(max_keys_per_offer=4))
    client, _ = make_puller(settings(max_keys_per_offer=4))
    try:
        keys = make_keys(5)
        warm(h.pool, keys)
        # The puller's own cap: refused before anything is sent.
        offered = await client.offer("127.0.0.1", h.port, keys, deadline=deadline())
        assert offered.num_held == 0 and "max_keys_per_offer" in (offered.reason or "")
        # A hostile puller that ignores it: the holder closes the session, pins nothing.
        channel = await raw_session(h.port)
        try:
            await channel.send_frame(Offer(tuple(keys)))
            assert await holder_closed(channel)
        finally:
            channel.close()
        assert h.server.offers is not None and h.server.offers.stats().refused_total == 1
        h.assert_baseline()
        # pull offers what fits and recomputes the rest.
        pulled = await client.pull("127.0.0.1", h.port, keys, deadline=deadline())
        assert pulled.usable == 4 and "max_keys_per_offer" in (pulled.reason or "")
        assert not pulled.holder_short
    finally:
        await client.close()
        await h.server.stop()


async def test_offer_flood_pins_a_bounded_number_of_pages_until_the_lease() -> None:
    """Offers never fetched: one session holds at most max_open_offers_per_session supplies
    (the next offer closes it), all sessions together at most max_open_offers (the next is
    answered num_held 0, however often the flooder reconnects), and every one ends by the lease.
    """
    s = settings(max_open_offers_per_session=3, max_open_offers=5, offer_lease_s=0.5, lease_s=60.0)
    h = await make_holder(s)
    try:
        keys = make_keys(4)
        warm(h.pool, keys)
        flooders = [await raw_session(h.port) for _ in range(3)]
        try:
            for _ in range(3):
                assert (await offer_on(flooders[0], keys)).num_held == 4
            await flooders[0].send_frame(Offer(tuple(keys)))  # the fourth on one session
            assert await holder_closed(flooders[0])
            # Closing the session does not end its supplies (a fetch may come on another
            # connection): they stay pinned, counted against the global cap, until the lease.
            assert h.registry.stats().requests == 3
            for _ in range(2):
                assert (await offer_on(flooders[1], keys)).num_held == 4
            refused = await offer_on(flooders[2], keys)  # a new session: the global cap holds
            assert refused.num_held == 0 and refused.kv_request_id is None
            assert h.registry.stats().requests == 5 and h.registry.stats().held_pages == 20
            assert h.server.offers is not None and h.server.offers.stats().refused_total == 2
            await wait_until(lambda: h.registry.stats().requests == 0, timeout=5.0)
            h.assert_baseline()
            assert (await offer_on(flooders[2], keys)).num_held == 4  # room again after the lease
        finally:
            for channel in flooders:
                channel.close()
        await wait_until(lambda: h.registry.stats().requests == 0, timeout=5.0)
        h.assert_baseline()
    finally:
        await h.server.stop()


async def test_offer_while_a_fetch_is_in_flight_closes_the_session(holder: Holder) -> None:
    """Offers are answered only on an idle session, so a block's frames are never split."""
    keys = make_keys(2)
    warm(holder.pool, keys)
    channel = await raw_session(holder.port)
    try:
        # A fetch for an id nobody opened waits (unknown_request_wait_s) before failing.
        await channel.send_frame(Fetch(rid("f" * 32), tuple(keys), 5000))
        await channel.send_frame(Offer(tuple(keys)))
        assert await holder_closed(channel, skip_fail=True)
    finally:
        channel.close()
    holder.assert_baseline()


async def test_offered_frame_is_validated() -> None:
    with pytest.raises(ProtocolError):
        decode_frame(encode_body(Offered(None, 3)))
    with pytest.raises(ProtocolError):
        decode_frame(encode_body(Offered(rid("a" * 32), 0)))
    assert decode_frame(encode_body(Offered(None, 0))) == Offered(None, 0)


async def test_a_server_without_holdings_answers_no_offers(
    puller: tuple[P2PClient, HostPagePool],
) -> None:
    client, _ = puller
    s = settings()
    registry = SupplyRegistry(s.lease_s)
    server = P2PServer(s, LocalIdentity(PeerNodeId("plain"), FINGERPRINT, None), registry)
    await server.start()
    try:
        offered = await client.offer("127.0.0.1", server.port, make_keys(2), deadline=deadline())
        assert offered.num_held == 0 and "transport" in (offered.reason or "")
    finally:
        await server.stop()


async def test_offer_naming_a_group_the_layout_lacks_closes_the_session(holder: Holder) -> None:
    keys = make_keys(2)
    warm(holder.pool, keys)
    channel = await raw_session(holder.port)
    try:
        await channel.send_frame(Offer((keys[0], *make_keys(1, group=7))))
        assert await holder_closed(channel)
    finally:
        channel.close()
    holder.assert_baseline()
