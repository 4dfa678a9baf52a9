"""Shared by the symmetric-pull tests: a holder (pool, P2P tier, server with holdings) and a
puller (client over its own pool), over loopback with real pools and sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvtier.errors import ProtocolError
from kvtier.keys import OffloadKey
from kvtier.offload.pool import HostPagePool
from kvtier.p2p import (
    LocalIdentity,
    P2PClient,
    P2PServer,
    P2PSettings,
    P2PTier,
    PoolHoldings,
    PoolSink,
    SupplyRegistry,
)
from kvtier.p2p.channel import FrameChannel
from kvtier.p2p.frames import KvRequestId, Offer, Offered, PeerNodeId

from .conftest import FINGERPRINT, new_pool, settings, write_page

SECRET = b"offer-test-secret-0123456789abcdef"


@dataclass
class Holder:
    pool: HostPagePool
    registry: SupplyRegistry
    tier: P2PTier
    server: P2PServer

    @property
    def port(self) -> int:
        return self.server.port

    def assert_baseline(self) -> None:
        stats = self.pool.stats()
        assert stats.referenced == 0 and stats.writing == 0, stats
        supply = self.registry.stats()
        assert (supply.requests, supply.held_pages, supply.sending) == (0, 0, 0), supply


async def make_holder(s: P2PSettings, *, secret: bytes | None = None) -> Holder:
    pool = new_pool()
    registry = SupplyRegistry(s.lease_s)
    tier = P2PTier(pool, registry, FINGERPRINT)
    identity = LocalIdentity(PeerNodeId("holder"), FINGERPRINT, secret)
    server = P2PServer(s, identity, registry, holdings=PoolHoldings(tier))
    await server.start()
    return Holder(pool, registry, tier, server)


def make_puller(
    s: P2PSettings | None = None, *, secret: bytes | None = None, pool: HostPagePool | None = None
) -> tuple[P2PClient, HostPagePool]:
    pool = pool or new_pool()
    identity = LocalIdentity(PeerNodeId("puller"), FINGERPRINT, secret)
    return P2PClient(s or settings(), identity, PoolSink(pool)), pool


def warm(pool: HostPagePool, keys: list[OffloadKey]) -> None:
    for key in keys:
        write_page(pool, key)


def deadline(s: float = 5.0) -> float:
    return time.monotonic() + s


def held_bytes(pool: HostPagePool, key: OffloadKey) -> bytes:
    with pool.acquire(key) as ref:
        return bytes(ref.view)


@contextlib.asynccontextmanager
async def running_holder() -> AsyncIterator[Holder]:
    """The tests' default holder (offers leased for 30 s), stopped on exit."""
    h = await make_holder(settings(offer_lease_s=30.0))
    try:
        yield h
    finally:
        await h.server.stop()


@contextlib.asynccontextmanager
async def running_puller() -> AsyncIterator[tuple[P2PClient, HostPagePool]]:
    """The tests' default puller, closed on exit."""
    client, pool = make_puller()
    try:
        yield client, pool
    finally:
        await client.close()


def rid(text: str) -> KvRequestId:
    return KvRequestId(text)


async def offer_on(channel: FrameChannel, keys: list[OffloadKey]) -> Offered:
    await channel.send_frame(Offer(tuple(keys)))
    frame = await asyncio.wait_for(channel.read_frame(), timeout=5)
    assert isinstance(frame, Offered), frame
    return frame


async def holder_closed(channel: FrameChannel, *, skip_fail: bool = False) -> bool:
    """True when the holder closes the session (EOF) without answering an offer."""
    try:
        while True:
            frame = await asyncio.wait_for(channel.read_frame(), timeout=5)
            if frame is None:
                return True
            assert skip_fail and not isinstance(frame, Offered), frame
    except ProtocolError:  # the connection reset
        return True
