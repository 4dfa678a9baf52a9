"""Consumer sessions: authenticated connections to producers, reused per producer.

A session carries one fetch at a time. :class:`SessionPool` hands out an idle session to the
same producer when one is still alive (not closed by the producer, not idle for more than half
the producer's idle timeout), else connects and runs the handshake, each step bounded by its
timeout. When the caller names the producer's node id, an idle session to another node is not
reused and a new one is refused by the handshake unless the peer proves it is that node.
Sessions that ended a fetch cleanly go back to the pool (at most
``max_sessions_per_peer`` idle per producer); anything else is closed by the caller.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field

from kvtier.p2p.channel import FrameChannel, tune_socket
from kvtier.p2p.handshake import LocalIdentity, PeerInfo, client_handshake
from kvtier.p2p.settings import P2PSettings

Peer = tuple[str, int]


@dataclass(slots=True)
class Session:
    """One handshaken connection to a producer."""

    channel: FrameChannel
    peer: PeerInfo
    last_used: float = field(default_factory=time.monotonic)
    reused: bool = False
    """True when taken from the pool (the producer may have closed it meanwhile)."""


class SessionPool:
    """Idle sessions per producer, and new ones on demand."""

    def __init__(self, settings: P2PSettings, identity: LocalIdentity) -> None:
        self.settings = settings
        self.identity = identity
        self._idle: dict[Peer, list[Session]] = {}
        self._closed = False
        self.opened = 0

    async def take(self, peer: Peer, expected_node_id: str | None = None) -> Session:
        """An idle live session to ``peer`` (that node, when named), or a new one (raises
        P2PError, OSError, timeout)."""
        idle = self._idle.get(peer, [])
        now = time.monotonic()
        while idle:
            session = idle.pop()
            fresh = now - session.last_used < self.settings.idle_session_s / 2
            right_node = expected_node_id is None or session.peer.node_id == expected_node_id
            if fresh and right_node and _alive(session):
                session.reused = True
                return session
            session.channel.close()
        return await self.connect(peer, expected_node_id)

    async def connect(self, peer: Peer, expected_node_id: str | None = None) -> Session:
        """A new session: TCP connect, then the handshake."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(peer[0], peer[1], type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            tune_socket(sock, self.settings.socket_buffer_bytes)
            async with asyncio.timeout(self.settings.connect_timeout_s):
                await loop.sock_connect(sock, address)
            channel = FrameChannel(sock, self.settings.max_frame_bytes)
        except BaseException:
            sock.close()
            raise
        try:
            async with asyncio.timeout(self.settings.handshake_timeout_s):
                info = await client_handshake(channel, self.identity, expected_node_id)
        except BaseException:
            channel.close()
            raise
        self.opened += 1
        return Session(channel, info)

    def give_back(self, peer: Peer, session: Session) -> None:
        """A session whose last exchange ended cleanly (frames in sync)."""
        idle = self._idle.setdefault(peer, [])
        if self._closed or len(idle) >= self.settings.max_sessions_per_peer:
            session.channel.close()
            return
        session.last_used = time.monotonic()
        idle.append(session)

    def close(self) -> None:
        self._closed = True
        for sessions in self._idle.values():
            for session in sessions:
                session.channel.close()
        self._idle.clear()


def _alive(session: Session) -> bool:
    """False when the producer already closed an idle connection (EOF or error pending)."""
    try:
        session.channel.sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True  # nothing pending: the connection is open and in sync
    except OSError:
        return False
    # EOF (b"") or unasked bytes from an idle producer (the stream is out of sync): unusable.
    return False
