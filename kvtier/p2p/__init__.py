"""Peer-to-peer KV transport: producer server, consumer client, and the P2P secondary tier.

DESIGN §5. A prefill worker (producer) serves the pages of each producer leg, registered under
the leg's ``kv_request_id`` K; a decode worker (consumer) fetches the keys it lacks straight into
its host pages. Transport: TCP + length-prefixed msgpack control frames, raw payloads
(:mod:`kvtier.p2p.frames`), a handshake with version, node id, layout fingerprint and mutual
HMAC-SHA256 over nonces (:mod:`kvtier.p2p.handshake`; without ``KVTIER_P2P_SECRET`` only
loopback peers are accepted, and the server logs so).

Modules: ``frames`` (wire format), ``layout`` (fingerprint), ``handshake``, ``channel``
(zero-copy framed socket I/O), ``supply`` (producer registry: references, waits, leases),
``server`` (producer endpoint), ``sessions`` + ``client`` (consumer), ``pool_pages`` (adapters to
``kvtier.offload.HostPagePool``), ``tier`` (the ``SecondaryTier``), ``settings``.

Producer side (inside the worker's asyncio loop)::

    settings = P2PSettings()                       # KVTIER_P2P_* from the environment
    fingerprint = LayoutFingerprint(hash_seed, block_size, "float16", page_bytes_per_group)
    identity = LocalIdentity.from_settings(node_id, fingerprint, settings)
    registry = SupplyRegistry(settings.lease_s, released_memory=settings.released_memory)
    server = P2PServer(settings, identity, registry)
    await server.start()                           # server.port: the port to advertise
    tier = P2PTier(pool, registry, fingerprint)    # a SecondaryTier for the TieringManager
    ...
    await server.stop()                            # closes sessions, releases all supply

With the tier in the manager, producer legs register their supply by themselves. Without it
(or in addition), a worker drives the registry directly from any thread:
``registry.open(K)`` when the leg starts, ``registry.supply(K, key, page)`` for each readable
page (a :class:`SupplyPage`, e.g. :class:`PoolSupplyPage` over a pool ``PageRef``),
``registry.park(K, key)`` / ``registry.fail(K, key, reason)`` for in-flight / failed writes,
``registry.finish(K)`` when the leg is done (unmet demand then fails at once) and
``registry.release(K, reason)`` to drop it.

Consumer side::

    client = P2PClient(settings, identity, PoolSink(pool))
    result = await client.fetch(remote_host, remote_port, K, keys, deadline)
    # result.usable leading keys of ``keys`` are in the host pool now; load them to the GPU.
    # result.reason says why the prefix ended early (recompute from there); never raises for
    # transport failures, always returns by ``deadline`` (a time.monotonic() value).
    await client.release(remote_host, remote_port, K)   # e.g. the client went away
    await client.close()
"""

from kvtier.p2p.client import BlockSink, FetchResult, P2PClient, PageReservation
from kvtier.p2p.frames import PROTOCOL_VERSION, KvRequestId, PeerNodeId
from kvtier.p2p.handshake import LocalIdentity
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.pool_pages import PoolSink, PoolSupplyPage
from kvtier.p2p.server import P2PServer
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.supply import SupplyPage, SupplyRegistry
from kvtier.p2p.tier import P2P_TIER, P2PTier

__all__ = [
    "P2P_TIER",
    "PROTOCOL_VERSION",
    "BlockSink",
    "FetchResult",
    "KvRequestId",
    "LayoutFingerprint",
    "LocalIdentity",
    "P2PClient",
    "P2PServer",
    "P2PSettings",
    "P2PTier",
    "PageReservation",
    "PeerNodeId",
    "PoolSink",
    "PoolSupplyPage",
    "SupplyPage",
    "SupplyRegistry",
]
