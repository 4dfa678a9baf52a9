"""Peer-to-peer KV transport: producer server, consumer client, and the P2P secondary tier.

DESIGN §5. A prefill worker (producer) serves the pages of each producer leg, registered under
the leg's ``kv_request_id`` K; a decode worker (consumer) fetches the keys it lacks straight into
its host pages. Transport: TCP + length-prefixed msgpack control frames, raw payloads
(:mod:`kvtier.p2p.frames`; one ``blocks`` header per batch of pages), a handshake with version,
node ids, layout fingerprint and a mutual proof of the shared secret that derives per-session
keys (:mod:`kvtier.p2p.handshake`, :mod:`kvtier.p2p.sealing`); every later frame carries a MAC
under those keys, every page payload a tag under the producer's page key (below).

Threat model (who may connect, what they can make it do)
--------------------------------------------------------

*Assets.* KV pages are derived from users' prompts (confidential), and a consumer installs
fetched pages in its shared prefix cache: a forged page would change the answers of every later
request with that prefix, whoever sends it (cross-tenant poisoning).

*Who may connect.* Anyone who can reach the producer's P2P port may open a TCP connection. Only
a peer holding ``KVTIER_P2P_SECRET`` completes the handshake. Without a secret configured, both
ends accept loopback peers only: then every local process is trusted, and nothing else is.

*What an unauthenticated peer can make the server do.* A bounded handshake, nothing more
(:mod:`kvtier.p2p.admission`): it receives one ``hello`` (version, node id, layout fingerprint,
a fresh nonce — no page, no kv_request_id); the server reads at most one frame of at most
:data:`~kvtier.p2p.frames.HANDSHAKE_MAX_FRAME_BYTES` (4 KiB) from it within
``handshake_timeout_s`` (2 s: the deadline for its first frame); per source address a token
bucket limits handshake attempts and a cap limits concurrent ones; a global cap bounds all
unauthenticated connections, and when it is reached a new connection evicts the oldest pending
one of the address holding the most (so a few addresses cannot keep every slot: a legitimate
peer from another address is admitted, and completes its handshake in a round trip). Refusals
and evictions are counted in :meth:`P2PServer.stats`, never logged one by one, so a flood costs
neither memory nor log volume. ``max_connections`` counts authenticated sessions only, so
unauthenticated peers cannot take the slots of legitimate ones. What remains is availability
against a flood from very many source addresses, each opening connections faster than a
legitimate handshake's round trip: it can evict legitimate handshakes too, and new sessions
then fail until it stops; consumers recompute meanwhile (slower, never wrong).

*What the secret protects.* Proofs bind the secret to both nonces, both node ids, the
fingerprint and the version; the session keys (HKDF-SHA256, one per direction) are derived from
the same transcript. A captured handshake cannot be replayed (fresh nonces). A peer that relays
a consumer's handshake to the real producer (the relay attack) gets an authenticated session it
cannot use: every frame after ``welcome`` carries a GMAC under a key it does not know, with a
per-direction sequence number, so it cannot forge, alter, replay, reorder, drop or reflect
anything without the consumer (or producer) noticing and closing the session. Every block
payload carries a GMAC tag under the producer's page key (random per producer, computed once
per page write, cached with the page), and the tag travels in the session-MACed ``blocks``
header that announces the page (with up to 63 others); the page key reaches the consumer only
encrypted under a key derived from the session (``welcome``), so the relay can neither read it
nor substitute its own.
The consumer verifies each payload before the page becomes readable (I6); a failure ends the
usable prefix there and the rest is recomputed. Given the producer's node id (its answer's
``remote_engine_id``, passed on by the proxy), a consumer refuses any other node, so a wrong
``remote_host`` cannot hand it another producer's pages. ``kv_request_id`` is 128 random bits:
an authenticated peer that guesses one gets "unknown kv_request_id".

*What the secret does not protect.* Confidentiality: pages cross the wire in clear (integrity
without encryption keeps the transfer near socket speed). Anyone who can read the fabric can
read prompts' KV; put P2P on a private network, or a VPN/IPsec/WireGuard link, when that is not
acceptable. Every holder of the secret is trusted as a producer and a consumer: one secret per
trust domain. The secret is not rotated by the protocol; rotate it by restarting peers.

*Trusted fabrics.* There is no integrity opt-out: the producer tags a page once per write (not
per fetch) and the consumer verifies it once, one GMAC pass over the page, on a worker thread
where the process has spare cores, else the moment it landed (:mod:`kvtier.p2p.installs`);
``loadtest/bench_p2p`` prints its share of the raw socket's transfer time. A private fabric
still gains from detecting corruption. On a private network with one tenant the secret still
keeps strangers' processes (e.g. a compromised neighbour container) away from prompt-derived
pages.

Modules: ``frames`` (wire format), ``layout`` (fingerprint), ``sealing`` (key schedule, MACs,
page keys and tags), ``handshake``, ``admission`` (pre-auth limits, server counters),
``channel`` (zero-copy framed socket I/O, sealed after the handshake), ``supply`` (producer
registry: references, tags, waits, leases), ``server`` (producer endpoint) + ``serving`` (one
authenticated session's fetches and offers), ``sessions`` + ``client`` (consumer), ``receive``
(consumer: one fetch's blocks into the sink's pages), ``installs`` (consumer: verify each
page as it lands, commit in arrival order), ``sink``
(where a consumer installs pages), ``pool_pages`` (adapters to
``kvtier.offload.HostPagePool``), ``page_tags`` (tags cached per pool page write), ``tier``
(the ``SecondaryTier``), ``offer`` (symmetric pull: holder and puller sides, and the
threat model of offers), ``settings``.

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
    result = await client.fetch(remote_host, remote_port, K, keys, deadline,
                                expected_node_id=remote_engine_id)
    # result.usable leading keys of ``keys`` are in the host pool now; load them to the GPU.
    # result.reason says why the prefix ended early (recompute from there); never raises for
    # transport failures, always returns by ``deadline`` (a time.monotonic() value).
    await client.release(remote_host, remote_port, K)   # e.g. the client went away
    await client.close()

Symmetric pull (vLLM's ``remote_kv_source``, :mod:`kvtier.p2p.offer`): any node can be a
HOLDER that answers offers from its pages, with no producer leg::

    server = P2PServer(settings, identity, registry, holdings=PoolHoldings(tier))
    ...
    result = await client.pull(holder_host, holder_port, keys, deadline=deadline,
                               expected_node_id=holder_node_id)
    # offer (the holder pins the leading run it holds under a fresh K2, short lease) +
    # fetch of that run under K2 + done; result reads like fetch's.
"""

from kvtier.p2p.admission import ServerStats
from kvtier.p2p.client import FetchResult, P2PClient
from kvtier.p2p.frames import PROTOCOL_VERSION, KvRequestId, PeerNodeId
from kvtier.p2p.handshake import LocalIdentity
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.offer import HeldPage, Holdings, OfferResult, PoolHoldings
from kvtier.p2p.pool_pages import PoolSink, PoolSupplyPage
from kvtier.p2p.server import P2PServer
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.sink import BlockSink, PageReservation
from kvtier.p2p.supply import SupplyPage, SupplyRegistry
from kvtier.p2p.tier import P2P_TIER, P2PTier

__all__ = [
    "P2P_TIER",
    "PROTOCOL_VERSION",
    "BlockSink",
    "FetchResult",
    "HeldPage",
    "Holdings",
    "KvRequestId",
    "LayoutFingerprint",
    "LocalIdentity",
    "OfferResult",
    "P2PClient",
    "P2PServer",
    "P2PSettings",
    "P2PTier",
    "PageReservation",
    "PeerNodeId",
    "PoolHoldings",
    "PoolSink",
    "PoolSupplyPage",
    "ServerStats",
    "SupplyPage",
    "SupplyRegistry",
]
