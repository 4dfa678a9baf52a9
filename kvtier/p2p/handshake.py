"""The P2P handshake: version, node ids, layout fingerprint, mutual proof, session keys.

1. server → ``hello {version, node_id, fingerprint, nonce, auth}``
2. client → ``auth {version, node_id, fingerprint, nonce, mac}``: ``mac`` is the client's
   proof over the transcript (both nonces, both node ids, the fingerprint, the version), under
   a key derived from the shared secret (:mod:`kvtier.p2p.sealing`).
3. server checks version, fingerprint and proof (or, when it has no secret, that the peer is on
   loopback); it then either answers ``refuse {reason}`` and closes, or ``welcome {mac,
   page_key}`` with its own proof over the same transcript and its page key encrypted under the
   session's wrap key.
4. the client checks the server's proof and, when it was told which producer it talks to, that
   the server's node id is that one (the id is part of the proven transcript, so a relay cannot
   substitute another node's hello); it then unwraps the page key (IntegrityError if it was
   not wrapped for this session).
5. both ends seal the channel with the per-direction session keys: nothing after ``welcome`` is
   accepted without a MAC under a key only the two ends hold, and no payload is accepted
   without a tag under the page key that only the producer and its authenticated peers hold.

Without a secret the same steps run with an empty secret, and both ends accept only loopback
peers: the keys then catch corruption, not attackers (any local process is trusted).

The server logs refusals at debug level only (an unauthenticated peer must not be able to fill
the log); it counts them (:class:`kvtier.p2p.admission.ServerStats`). The client logs them.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

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
from kvtier.p2p.sealing import PageOpener, PageSealer, SessionSecrets, Transcript, proofs_match
from kvtier.p2p.settings import P2PSettings

logger = logging.getLogger(__name__)


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
    """True when the peer proved the shared secret (False: loopback-only mode)."""


Admit = Callable[[PeerNodeId], str | None]
"""Called by the server once the client proved itself: a refusal reason, or None to admit."""


async def _refuse(channel: FrameChannel, reason: str, side: str) -> HandshakeRefused:
    # The server's refusals are counted by its caller; a log line per refused peer would let
    # anyone who can connect fill the log.
    log = logger.debug if side == "server" else logger.warning
    log("p2p %s refused peer %s: %s", side, channel.peer, reason)
    with contextlib.suppress(ProtocolError):
        await channel.send_frame(Refuse(reason))
    return HandshakeRefused(reason)


async def server_handshake(
    channel: FrameChannel,
    me: LocalIdentity,
    admit: Admit | None = None,
    pages: PageSealer | None = None,
) -> PeerInfo:
    """Run the server side and seal ``channel``; raises HandshakeRefused (after telling the
    peer) or ProtocolError.

    ``pages``: the producer's page key (its registry's); None draws one for this session only.
    """
    if me.secret is None and not is_loopback(channel.peer):
        raise await _refuse(channel, "no shared secret configured: only loopback peers", "server")
    nonce = secrets.token_bytes(NONCE_BYTES)
    await channel.send_frame(
        Hello(PROTOCOL_VERSION, me.node_id, me.fingerprint, nonce, me.secret is not None)
    )
    frame = await channel.read_frame()
    if isinstance(frame, Refuse):
        logger.debug("p2p client %s refused us: %s", channel.peer, frame.reason)
        raise HandshakeRefused(frame.reason)
    if not isinstance(frame, Auth):
        name = type(frame).__name__ if frame is not None else "end of stream"
        raise await _refuse(channel, f"expected auth, got {name}", "server")
    if frame.version != PROTOCOL_VERSION:
        reason = f"protocol version {frame.version} != {PROTOCOL_VERSION}"
        raise await _refuse(channel, reason, "server")
    mismatch = me.fingerprint.mismatch(frame.fingerprint)
    if mismatch is not None:
        raise await _refuse(channel, mismatch, "server")
    transcript = Transcript(
        PROTOCOL_VERSION, me.node_id, frame.node_id, me.fingerprint, nonce, frame.nonce
    )
    keys = SessionSecrets.derive(me.secret, transcript)
    if not proofs_match(keys.client_proof, frame.mac):
        raise await _refuse(channel, "authentication failed", "server")
    if admit is not None and (busy := admit(frame.node_id)) is not None:
        raise await _refuse(channel, busy, "server")
    if pages is None:
        pages = PageSealer()
    await channel.send_frame(Welcome(keys.server_proof, keys.wrap_page_key(pages.key)))
    channel.seal(keys.server_to_client, keys.client_to_server, page_sealer=pages)
    return PeerInfo(frame.node_id, me.secret is not None)


async def client_handshake(
    channel: FrameChannel, me: LocalIdentity, expected_node_id: str | None = None
) -> PeerInfo:
    """Run the client side and seal ``channel``; raises HandshakeRefused or ProtocolError.

    ``expected_node_id``: the producer this client was sent to; any other node is refused.
    """
    frame = await channel.read_frame()
    if isinstance(frame, Refuse):
        logger.warning("p2p server %s refused us: %s", channel.peer, frame.reason)
        raise HandshakeRefused(frame.reason)
    if not isinstance(frame, Hello):
        name = type(frame).__name__ if frame is not None else "end of stream"
        raise await _refuse(channel, f"expected hello, got {name}", "client")
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
    if expected_node_id is not None and frame.node_id != expected_node_id:
        reason = f"peer is node {frame.node_id!r}, not the expected {expected_node_id!r}"
        raise await _refuse(channel, reason, "client")
    my_nonce = secrets.token_bytes(NONCE_BYTES)
    transcript = Transcript(
        PROTOCOL_VERSION, frame.node_id, me.node_id, me.fingerprint, frame.nonce, my_nonce
    )
    keys = SessionSecrets.derive(me.secret, transcript)
    await channel.send_frame(
        Auth(PROTOCOL_VERSION, me.node_id, me.fingerprint, my_nonce, keys.client_proof)
    )
    answer = await channel.read_frame()
    if isinstance(answer, Refuse):
        logger.warning("p2p server %s refused us: %s", channel.peer, answer.reason)
        raise HandshakeRefused(answer.reason)
    if not isinstance(answer, Welcome):
        name = type(answer).__name__ if answer is not None else "end of stream"
        raise ProtocolError(f"expected welcome, got {name}")
    if not proofs_match(keys.server_proof, answer.mac):
        logger.warning("p2p server %s failed to prove the shared secret", channel.peer)
        raise HandshakeRefused("server failed authentication")
    page_opener = PageOpener(keys.unwrap_page_key(answer.page_key))
    channel.seal(keys.client_to_server, keys.server_to_client, page_opener=page_opener)
    return PeerInfo(frame.node_id, me.secret is not None)
