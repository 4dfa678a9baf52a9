"""The P2P handshake: version, node id, layout fingerprint and mutual HMAC authentication.

1. server → ``hello {version, node_id, fingerprint, nonce, auth}``
2. client → ``auth {version, node_id, fingerprint, nonce, mac}`` where ``mac`` is
   HMAC-SHA256(secret, "client" ‖ server nonce ‖ client node id ‖ fingerprint) when the client
   has a secret, else empty.
3. server checks version, fingerprint and mac (or, when it has no secret, that the peer is on
   loopback) and answers ``welcome {mac}`` with its own proof over the client nonce, or
   ``refuse {reason}`` and closes.
4. a client with a secret checks the server's proof; a client without one talks only to loopback.

Both sides log every refusal with its reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass

import msgpack

from kvtier.errors import HandshakeRefused, ProtocolError
from kvtier.p2p.channel import FrameChannel, is_loopback
from kvtier.p2p.frames import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Auth,
    Hello,
    PeerNodeId,
    Refuse,
    Welcome,
)
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.settings import P2PSettings

logger = logging.getLogger(__name__)

_DOMAIN = b"kvtier-p2p/v1\x00"


@dataclass(frozen=True, slots=True)
class LocalIdentity:
    """Who this end is: node id, layout, and the shared secret (None: loopback only)."""

    node_id: PeerNodeId
    fingerprint: LayoutFingerprint
    secret: bytes | None

    @classmethod
    def from_settings(
        cls, node_id: str, fingerprint: LayoutFingerprint, settings: P2PSettings
    ) -> LocalIdentity:
        """The identity with ``settings.secret`` (``KVTIER_P2P_SECRET``) as the shared secret."""
        secret = settings.secret.get_secret_value().encode() if settings.secret else None
        return cls(PeerNodeId(node_id), fingerprint, secret or None)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """The other end after a successful handshake."""

    node_id: PeerNodeId
    authenticated: bool


def proof(secret: bytes, role: bytes, nonce: bytes, node_id: str, fp: LayoutFingerprint) -> bytes:
    """HMAC-SHA256 binding role, nonce, node id and layout (no reflection between roles)."""
    msg = b"".join(
        (_DOMAIN, role, b"\x00", nonce, node_id.encode(), b"\x00", msgpack.packb(fp.to_wire()))
    )
    return hmac.new(secret, msg, hashlib.sha256).digest()


async def _refuse(channel: FrameChannel, reason: str, side: str) -> HandshakeRefused:
    logger.warning("p2p %s refused peer %s: %s", side, channel.peer, reason)
    with contextlib.suppress(ProtocolError):
        await channel.send_frame(Refuse(reason))
    return HandshakeRefused(reason)


async def server_handshake(channel: FrameChannel, me: LocalIdentity) -> PeerInfo:
    """Run the server side; raises HandshakeRefused (after telling the peer) or ProtocolError."""
    if me.secret is None and not is_loopback(channel.peer):
        raise await _refuse(channel, "no shared secret configured: only loopback peers", "server")
    nonce = secrets.token_bytes(NONCE_BYTES)
    await channel.send_frame(
        Hello(PROTOCOL_VERSION, me.node_id, me.fingerprint, nonce, me.secret is not None)
    )
    frame = await channel.read_frame()
    if isinstance(frame, Refuse):
        logger.warning("p2p client %s refused us: %s", channel.peer, frame.reason)
        raise HandshakeRefused(frame.reason)
    if not isinstance(frame, Auth):
        raise await _refuse(channel, f"expected auth, got {type(frame).__name__}", "server")
    if frame.version != PROTOCOL_VERSION:
        reason = f"protocol version {frame.version} != {PROTOCOL_VERSION}"
        raise await _refuse(channel, reason, "server")
    mismatch = me.fingerprint.mismatch(frame.fingerprint)
    if mismatch is not None:
        raise await _refuse(channel, mismatch, "server")
    server_mac = b""
    if me.secret is not None:
        want = proof(me.secret, b"client", nonce, frame.node_id, me.fingerprint)
        if not frame.mac or not hmac.compare_digest(want, frame.mac):
            raise await _refuse(channel, "authentication failed", "server")
        server_mac = proof(me.secret, b"server", frame.nonce, me.node_id, me.fingerprint)
    await channel.send_frame(Welcome(server_mac))
    return PeerInfo(frame.node_id, me.secret is not None)


async def client_handshake(channel: FrameChannel, me: LocalIdentity) -> PeerInfo:
    """Run the client side; raises HandshakeRefused or ProtocolError."""
    frame = await channel.read_frame()
    if isinstance(frame, Refuse):
        logger.warning("p2p server %s refused us: %s", channel.peer, frame.reason)
        raise HandshakeRefused(frame.reason)
    if not isinstance(frame, Hello):
        raise await _refuse(channel, f"expected hello, got {type(frame).__name__}", "client")
    if frame.version != PROTOCOL_VERSION:
        reason = f"protocol version {frame.version} != {PROTOCOL_VERSION}"
        raise await _refuse(channel, reason, "client")
    mismatch = me.fingerprint.mismatch(frame.fingerprint)
    if mismatch is not None:
        raise await _refuse(channel, mismatch, "client")
    if me.secret is None and not is_loopback(channel.peer):
        reason = "no shared secret configured: only loopback peers"
        raise await _refuse(channel, reason, "client")
    if me.secret is not None and not frame.auth:
        raise await _refuse(channel, "server does not authenticate", "client")
    if me.secret is None and frame.auth:
        reason = "server requires the shared secret; none is configured here"
        raise await _refuse(channel, reason, "client")
    my_nonce = secrets.token_bytes(NONCE_BYTES)
    mac = b""
    if me.secret is not None:
        mac = proof(me.secret, b"client", frame.nonce, me.node_id, me.fingerprint)
    await channel.send_frame(Auth(PROTOCOL_VERSION, me.node_id, me.fingerprint, my_nonce, mac))
    answer = await channel.read_frame()
    if isinstance(answer, Refuse):
        logger.warning("p2p server %s refused us: %s", channel.peer, answer.reason)
        raise HandshakeRefused(answer.reason)
    if not isinstance(answer, Welcome):
        raise ProtocolError(f"expected welcome, got {type(answer).__name__}")
    if me.secret is not None:
        want = proof(me.secret, b"server", my_nonce, frame.node_id, me.fingerprint)
        if not hmac.compare_digest(want, answer.mac):
            logger.warning("p2p server %s failed to prove the shared secret", channel.peer)
            raise HandshakeRefused("server failed authentication")
    return PeerInfo(frame.node_id, me.secret is not None)
