"""A P2P client over a blocking socket, byte by byte: for tests that speak the protocol by hand
(fuzzers, attackers) and need a real authenticated session to do it from.

It runs the same handshake as :func:`kvtier.p2p.handshake.client_handshake` with the library's
key schedule (:mod:`kvtier.p2p.sealing`), then seals and opens frames itself, so a test can
send exactly the bytes it wants: a valid sealed frame, the same frame twice, frames out of
order, raw garbage.
"""

from __future__ import annotations

import secrets
import socket

from kvtier.p2p.frames import (
    LENGTH_PREFIX,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Auth,
    Frame,
    Hello,
    PeerNodeId,
    Welcome,
    decode_frame,
    encode_body,
    encode_frame,
)
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.sealing import TAG_BYTES, Opener, Sealer, SessionSecrets, Transcript


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "closed"
        buf += chunk
    return buf


def recv_plain_frame(sock: socket.socket) -> Frame:
    (n,) = LENGTH_PREFIX.unpack(recv_exactly(sock, LENGTH_PREFIX.size))
    return decode_frame(recv_exactly(sock, n))


class BlockingPeer:
    """One authenticated client session (``secret`` None: loopback-only mode)."""

    def __init__(
        self,
        sock: socket.socket,
        fingerprint: LayoutFingerprint,
        secret: bytes | None = None,
        node_id: str = "blocking-peer",
    ) -> None:
        self.sock = sock
        hello = recv_plain_frame(sock)
        assert isinstance(hello, Hello), hello
        self.server_node_id = hello.node_id
        nonce = secrets.token_bytes(NONCE_BYTES)
        transcript = Transcript(
            PROTOCOL_VERSION, hello.node_id, node_id, fingerprint, hello.nonce, nonce
        )
        keys = SessionSecrets.derive(secret, transcript)
        auth = Auth(PROTOCOL_VERSION, PeerNodeId(node_id), fingerprint, nonce, keys.client_proof)
        sock.sendall(encode_frame(auth))
        welcome = recv_plain_frame(sock)
        assert isinstance(welcome, Welcome), welcome
        assert welcome.mac == keys.server_proof
        self.sealer = Sealer(keys.client_to_server)
        self.opener = Opener(keys.server_to_client)

    def sealed(self, frame: Frame) -> bytes:
        """``frame`` as the next sealed frame of this session (consumes a sequence number)."""
        body = encode_body(frame)
        head = LENGTH_PREFIX.pack(len(body) + TAG_BYTES) + body
        return head + self.sealer.tag(self.sealer.reserve(), head)

    def send(self, frame: Frame) -> bytes:
        data = self.sealed(frame)
        self.sock.sendall(data)
        return data

    def read(self) -> Frame:
        """The next sealed frame from the server, verified."""
        prefix = recv_exactly(self.sock, LENGTH_PREFIX.size)
        (n,) = LENGTH_PREFIX.unpack(prefix)
        data = recv_exactly(self.sock, n)
        self.opener.verify(prefix + data[:-TAG_BYTES], data[-TAG_BYTES:], "frame")
        return decode_frame(data[:-TAG_BYTES])
