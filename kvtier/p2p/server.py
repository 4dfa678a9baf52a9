"""Producer side: the P2P server that serves a :class:`SupplyRegistry` to authenticated peers.

Use inside the worker's asyncio loop::

    registry = SupplyRegistry(settings.lease_s, released_memory=settings.released_memory)
    server = P2PServer(settings, identity, registry)
    await server.start()          # binds settings.host:settings.port; server.port is the real one
    ...                           # the tier (or the worker) opens/supplies/finishes requests
    await server.stop()           # closes the listener and every session; releases all supply
                                  # and closes the registry (a restarted server needs a new one)

One listening port per worker. Who may connect and what they can make it do is the threat model
in :mod:`kvtier.p2p`; in short: anyone may open a connection, and until it proves the shared
secret it gets a bounded handshake and nothing else (:mod:`kvtier.p2p.admission`: per-peer rate
limit, per-peer pending cap, a full pending set evicts the oldest connection of the busiest
address, frames of a few KiB, ``handshake_timeout_s`` for the peer's first frame); refusals and
evictions are counted (:meth:`P2PServer.stats`), not logged one by one. ``max_connections``
bounds the authenticated sessions.

Each authenticated session is served by :class:`~kvtier.p2p.serving.SessionServer`: a reader
that accepts ``fetch``/``done``/``release``/``offer`` and a sender that serves fetches in order,
several readable pages per ``blocks`` frame; a key that cannot be served ends the fetch with one
``fail`` frame naming it and every later key. Every frame after the handshake, both ways, and
every block payload carries a MAC: frames under the session key, payloads under the
registry's page key with the tag computed once when the page was supplied
(:mod:`kvtier.p2p.sealing`). Malformed or unauthenticated input closes that session only, with
a logged reason; kv_request_ids fetched on a connection that goes away without ``done`` are
released. Every wait is bounded: handshake, idle session, demand per key (``demand_wait_s``
while the producer runs; none once it finished), and one fetch as a whole (``max_fetch_s``,
which also cuts off a consumer that stops reading).
"""

from __future__ import annotations

import asyncio
import logging
import socket

from kvtier.errors import HandshakeRefused, IntegrityError, ProtocolError
from kvtier.p2p.admission import HandshakeAdmission, ServerCounters, ServerStats
from kvtier.p2p.channel import FrameChannel, PeerClosed, tune_socket
from kvtier.p2p.frames import (
    KvRequestId,
    PeerNodeId,
)
from kvtier.p2p.handshake import LocalIdentity, PeerInfo, server_handshake
from kvtier.p2p.offer import Holdings, OfferDesk
from kvtier.p2p.serving import SessionServer
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.supply import SupplyRegistry
from kvtier.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class P2PServer:
    """The producer's listening endpoint (one per worker)."""

    def __init__(
        self,
        settings: P2PSettings,
        identity: LocalIdentity,
        registry: SupplyRegistry,
        *,
        holdings: Holdings | None = None,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.registry = registry
        self.offers = OfferDesk(settings, registry, holdings) if holdings is not None else None
        """Answers ``offer`` frames (symmetric pull, :mod:`kvtier.p2p.offer`) when the server
        was given ``holdings``; without them an offer closes the session."""
        self._serving = SessionServer(settings, identity.fingerprint, registry, self.offers)
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._channels: set[FrameChannel] = set()
        self._sessions = 0
        self._admission: HandshakeAdmission[_PendingConnection] = HandshakeAdmission(
            rate_per_s=settings.handshake_rate_per_s,
            burst=settings.handshake_burst,
            max_pending=settings.max_pending_handshakes,
            max_pending_per_peer=settings.max_pending_handshakes_per_peer,
        )
        self._counters = ServerCounters()
        self.port = 0

    @property
    def active_connections(self) -> int:
        """Open connections, authenticated or still in their handshake."""
        return len(self._channels)

    @property
    def refused_total(self) -> int:
        return self._counters.refused_total

    @property
    def protocol_errors_total(self) -> int:
        return self._counters.protocol_errors_total

    def stats(self) -> ServerStats:
        """Connection counters (for metrics): sessions, handshakes, refusals by kind."""
        admission = self._admission
        return self._counters.snapshot(
            admission.pending_total, self._sessions, admission.evicted_total
        )

    async def start(self) -> None:
        if self._listener is not None:
            return
        if self.identity.secret is None:
            logger.warning(
                "p2p server %s: no KVTIER_P2P_SECRET configured; non-loopback peers are refused",
                self.identity.node_id,
            )
        infos = socket.getaddrinfo(self.settings.host, self.settings.port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accept_task = asyncio.create_task(self._accept_loop(listener))
        self._lease_task = asyncio.create_task(self._lease_loop())
        logger.info(
            "p2p server %s listening on %s:%d", self.identity.node_id, self.settings.host, self.port
        )

    async def stop(self) -> None:
        """Close the listener and every session, then release all supply."""
        accept, lease = self._accept_task, self._lease_task
        self._accept_task = self._lease_task = None
        try:
            await cancel_and_wait(accept, lease)
        finally:
            await self._close_sessions()

    async def _close_sessions(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.registry.close()

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:
                logger.warning("p2p accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            self._counters.accepted_total += 1
            source = str(address[0]) if isinstance(address, tuple) and address else "?"
            pending = _PendingConnection(sock)
            refusal = self._admission.begin(source, pending)  # may evict an older connection
            if refusal is not None:
                # Counted, not logged: a flood must not turn into a log flood.
                self._counters.throttled_total += 1
                logger.debug("p2p closing connection from %s on accept: %s", source, refusal)
                sock.close()
                continue
            task = asyncio.create_task(self._connection(sock, source, pending))
            pending.task = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(pending.ended)

    async def _lease_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.lease_check_interval_s)
            self.registry.expire()

    async def _connection(
        self, sock: socket.socket, source: str, pending: _PendingConnection
    ) -> None:
        try:
            tune_socket(sock, self.settings.socket_buffer_bytes)
            channel = FrameChannel(sock, self.settings.max_frame_bytes)
        except OSError as exc:
            sock.close()
            self._admission.end(source, pending, authenticated=False)
            logger.debug("p2p connection setup failed: %s", exc)
            return
        self._channels.add(channel)
        slot = _SessionSlot(self)
        try:
            peer = await self._handshake(channel, source, pending, slot)
            if peer is not None:
                await self._serve_session(channel, peer)
        finally:
            slot.release()
            self._channels.discard(channel)
            channel.close()

    async def _handshake(
        self, channel: FrameChannel, source: str, pending: _PendingConnection, slot: _SessionSlot
    ) -> PeerInfo | None:
        """The peer, authenticated and holding ``slot``; None when refused or failed (counted;
        logged at debug level only: nothing an unauthenticated peer does is logged). Cancelled
        when the admission evicts ``pending``."""
        peer: PeerInfo | None = None
        try:
            async with asyncio.timeout(self.settings.handshake_timeout_s):
                peer = await server_handshake(
                    channel, self.identity, slot.take, self.registry.page_sealer
                )
        except HandshakeRefused:
            self._counters.refused_total += 1
        except (ProtocolError, TimeoutError, OSError) as exc:
            self._counters.handshake_failures_total += 1
            logger.debug("p2p handshake with %s failed: %r", channel.peer, exc)
        except Exception:  # a bug must cost this connection only, never the server
            logger.exception("p2p handshake with %s failed", channel.peer)
        finally:
            self._admission.end(source, pending, authenticated=peer is not None)
        if peer is not None:
            self._counters.authenticated_total += 1
        return peer

    async def _serve_session(self, channel: FrameChannel, peer: PeerInfo) -> None:
        owned: set[KvRequestId] = set()
        try:
            await self._serving.run(channel, peer, owned)
        except PeerClosed as exc:
            logger.info("p2p peer %s (%s) went away: %s", peer.node_id, channel.peer, exc)
        except ProtocolError as exc:
            self._counters.protocol_errors_total += 1
            if isinstance(exc, IntegrityError):
                self._counters.integrity_failures_total += 1
            logger.warning("p2p closing session %s (%s): %s", peer.node_id, channel.peer, exc)
        except TimeoutError:
            logger.warning(
                "p2p closing session %s (%s): idle or send timeout", peer.node_id, channel.peer
            )
        except Exception:  # a bug must cost this connection only, never the server
            logger.exception("p2p session %s (%s) failed", peer.node_id, channel.peer)
        finally:
            for kv_request_id in owned:
                self.registry.release(kv_request_id, "consumer disconnected")

    def _take_session(self) -> str | None:
        if self._sessions >= self.settings.max_connections:
            self._counters.busy_total += 1
            return f"server busy: {self._sessions} sessions open"
        self._sessions += 1
        return None

    def _end_session(self) -> None:
        self._sessions -= 1


class _PendingConnection:
    """One accepted connection while it has not authenticated: what the admission evicts."""

    __slots__ = ("sock", "task")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.task: asyncio.Task[None] | None = None

    def evict(self) -> None:
        # Cancelling closes the socket: the task's own cleanup if it ran, else ``ended``.
        if self.task is not None:
            self.task.cancel()
        else:
            self.sock.close()

    def ended(self, _task: asyncio.Task[None]) -> None:
        """The connection's task is done: an evicted one may have been cancelled before it ever
        ran (no cleanup of its own), so its socket is closed here (closing twice is harmless)."""
        self.sock.close()


class _SessionSlot:
    """One connection's claim on ``max_connections``: taken when the peer has proven the
    secret (before ``welcome``), released once when the connection ends, whichever way."""

    __slots__ = ("_server", "_taken")

    def __init__(self, server: P2PServer) -> None:
        self._server = server
        self._taken = False

    def take(self, node_id: PeerNodeId) -> str | None:
        """A refusal reason when every slot is taken; None when this one is now held."""
        refusal = self._server._take_session()
        self._taken = refusal is None
        return refusal

    def release(self) -> None:
        if self._taken:
            self._taken = False
            self._server._end_session()
