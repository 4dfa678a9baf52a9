"""A producer and a consumer in one process over loopback, with real pools and sockets."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import xxhash

from kvtier.keys import BlockHasher, OffloadKey, offload_key
from kvtier.offload.pool import BytearrayPageBuffer, HostPagePool
from kvtier.offload.types import ReqContext, RequestId
from kvtier.p2p import (
    LayoutFingerprint,
    LocalIdentity,
    P2PClient,
    P2PServer,
    P2PSettings,
    P2PTier,
    PoolSink,
    SupplyRegistry,
)
from kvtier.p2p.channel import FrameChannel, tune_socket
from kvtier.p2p.client import FetchResult
from kvtier.p2p.frames import KvRequestId, PeerNodeId
from kvtier.p2p.handshake import client_handshake

if TYPE_CHECKING:
    from .offer_peers import Holder

PAGE = 8192
FINGERPRINT = LayoutFingerprint("test-model", 4, "uint8", (PAGE, PAGE))
HASHER = BlockHasher("test-model", 4)


def make_keys(n: int, *, group: int = 0, start: int = 0) -> list[OffloadKey]:
    hashes = HASHER.hash_tokens(list(range(start, start + 4 * n)))
    return [offload_key(h, group) for h in hashes]


def payload(key: bytes, nbytes: int = PAGE) -> bytes:
    """Deterministic page content of ``key`` (different for every key)."""
    seed = xxhash.xxh3_128_digest(key)
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def write_page(pool: HostPagePool, key: OffloadKey, *, success: bool = True) -> None:
    pool.allocate(key)
    pool.write_view(key)[:] = payload(key, pool.page_nbytes)
    pool.complete_write(key, success)


def begin_write(pool: HostPagePool, key: OffloadKey) -> None:
    pool.allocate(key)
    pool.write_view(key)[:] = payload(key, pool.page_nbytes)


def settings(**overrides: object) -> P2PSettings:
    base: dict[str, object] = {
        "secret": None,
        "lease_s": 30.0,
        "lease_check_interval_s": 0.05,
        "fetch_timeout_s": 5.0,
        "demand_wait_s": 3.0,
        "unknown_request_wait_s": 0.2,
        "handshake_timeout_s": 2.0,
        "socket_buffer_bytes": 0,
    }
    base.update(overrides)
    return P2PSettings.model_validate(base)


def producer_ctx(kv_request_id: str, name: str = "req-p") -> ReqContext:
    return ReqContext(
        RequestId(name), kv_transfer_params={"remote_decoder": {"kv_request_id": kv_request_id}}
    )


@dataclass
class Pair:
    """One producer (pool, registry, tier, server) and one consumer (pool, client)."""

    producer_pool: HostPagePool
    consumer_pool: HostPagePool
    registry: SupplyRegistry
    tier: P2PTier
    server: P2PServer
    client: P2PClient

    @property
    def port(self) -> int:
        return self.server.port

    async def fetch(
        self, rid: str, keys: Sequence[OffloadKey], timeout: float = 5.0, *, finish: bool = True
    ) -> FetchResult:
        deadline = time.monotonic() + timeout
        return await self.client.fetch("127.0.0.1", self.port, rid, keys, deadline, finish=finish)

    def assert_baseline(self) -> None:
        """No page referenced or mid-write on either side, and no supply held."""
        for pool in (self.producer_pool, self.consumer_pool):
            stats = pool.stats()
            assert stats.referenced == 0, stats
            assert stats.writing == 0, stats
        supply = self.registry.stats()
        assert supply.held_pages == 0 and supply.sending == 0, supply


def new_pool(num_pages: int = 64) -> HostPagePool:
    return HostPagePool(BytearrayPageBuffer(num_pages, PAGE))


async def make_pair(
    server_settings: P2PSettings | None = None,
    client_settings: P2PSettings | None = None,
    *,
    server_secret: bytes | None = None,
    client_secret: bytes | None = None,
    client_fingerprint: LayoutFingerprint = FINGERPRINT,
    consumer_pages: int = 64,
) -> Pair:
    s_settings = server_settings or settings()
    c_settings = client_settings or settings()
    producer_pool = new_pool()
    consumer_pool = new_pool(consumer_pages)
    registry = SupplyRegistry(s_settings.lease_s)
    server = P2PServer(
        s_settings, LocalIdentity(PeerNodeId("producer"), FINGERPRINT, server_secret), registry
    )
    await server.start()
    tier = P2PTier(producer_pool, registry, FINGERPRINT)
    client = P2PClient(
        c_settings,
        LocalIdentity(PeerNodeId("consumer"), client_fingerprint, client_secret),
        PoolSink(consumer_pool),
    )
    return Pair(producer_pool, consumer_pool, registry, tier, server, client)


@pytest.fixture(params=[False, True], ids=["verify-on-loop", "verify-thread"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    """Both places a consumer verifies payloads (``P2PSettings.verify_thread``)."""
    p = await make_pair(client_settings=settings(verify_thread=request.param))
    try:
        yield p
    finally:
        await p.client.close()
        await p.server.stop()


@pytest.fixture(autouse=True)
def _capture_p2p_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.p2p")


def rid(n: int = 0) -> KvRequestId:
    return KvRequestId(f"{n:032x}")


CONSUMER = LocalIdentity(PeerNodeId("consumer"), FINGERPRINT, None)


async def raw_session(port: int, identity: LocalIdentity = CONSUMER) -> FrameChannel:
    """A handshaken connection to a producer, for tests that speak the protocol by hand."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        tune_socket(sock, 0)
        await loop.sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    channel = FrameChannel(sock, 1 << 20)
    try:
        await client_handshake(channel, identity)
    except BaseException:
        channel.close()
        raise
    return channel


async def wait_until(pred: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
async def holder() -> AsyncIterator[Holder]:
    """A symmetric-pull holder (:mod:`.offer_peers`, which imports this module: hence the
    imports inside these two fixtures)."""
    from .offer_peers import running_holder

    async with running_holder() as h:
        yield h


@pytest.fixture
async def puller() -> AsyncIterator[tuple[P2PClient, HostPagePool]]:
    """A symmetric-pull puller over its own pool (:mod:`.offer_peers`)."""
    from .offer_peers import running_puller

    async with running_puller() as p:
        yield p
