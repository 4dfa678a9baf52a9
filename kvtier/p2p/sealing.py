"""Session keys and MACs of one P2P connection (pure computation, no I/O).

Key schedule (HKDF-SHA256, RFC 5869, from the stdlib's HMAC):

- the *transcript* is everything both ends said in the handshake: protocol version, server
  node id, client node id, layout fingerprint, server nonce, client nonce;
- ``PRK = HKDF-Extract(salt = server nonce ‖ client nonce, IKM = shared secret)``;
- four outputs ``HKDF-Expand(PRK, label ‖ SHA-256(transcript), 32)``: the client's proof, the
  server's proof, the client→server key and the server→client key.

A peer proves it holds the secret with a proof over the whole transcript, and every byte after
the handshake is authenticated under a key that exists only on the two ends: a relay that saw
the handshake learns nothing it can use (it can forward bytes, never change or inject them).

After the handshake each direction is a :class:`Sealer` (sending end) / :class:`Opener`
(receiving end) pair over AES-256-GCM used as a MAC (GMAC: empty plaintext, the authenticated
bytes as associated data), with a 96-bit nonce ``0 ‖ sequence number``. Each control frame
consumes the next sequence number of its direction, and the number is never sent: a replayed,
dropped, reordered or reflected frame (the two directions have different keys) fails
verification. A sequence number is never reused under a key, as GCM requires.

Page payloads are authenticated once per page, not once per send (since protocol v3). A
producer holds one random *page key* (:class:`PageSealer`, one per
:class:`~kvtier.p2p.supply.SupplyRegistry`) and tags each page with GMAC under it the first
time the page is supplied after its write completed (:class:`PageTag`: a 64-bit counter nonce,
never reused under the key, and the 16-byte MAC); the tag is cached with the page and sent in
the ``blocks`` header that announces the page, itself a control frame MACed under the session
key. The page key reaches the consumer in the
``welcome`` frame, encrypted with AES-256-GCM under a fifth session output (the *wrap key*), so
only the two ends of an authenticated session learn it: a relay or an on-path attacker without
the secret can neither read it nor swap it. The consumer verifies every payload it installs
(:class:`PageOpener`) against the tag from that authenticated header; changing one payload byte
fails, and the tag itself cannot be changed (the header's session MAC), nor an old header
replayed (session sequence numbers). The page key is shared by every session of the producer:
every holder of the secret can already serve pages, so it reveals nothing new to a peer; to
one without the secret it is never visible.

Why GMAC: measured on the project's machine (AMD EPYC, AES-NI/VAES/PCLMUL) over 512 KiB pages,
in one thread: AES-GCM as a MAC 8-19 GiB/s, ChaCha20-Poly1305 7-12, Poly1305 5-10, BLAKE3 5
(extra package), SHA-256 1.4-1.6, HMAC-SHA256 1.5, BLAKE2b 0.5-0.65 GiB/s; a raw loopback
socket moves 1.3-3.7 GiB/s there. Only the AEAD-based MACs leave the transfer near socket speed;
xxh3 (40+ GiB/s) is not a MAC at all. A keyed tag computed once per page (rather than an unkeyed
digest such as SHA-256, which the receiver would have to recompute at 1.5 GiB/s, slower than the
socket) keeps the receiver's check at GMAC speed and takes the producer's per-fetch pass over
the page (a cold read of DRAM, racing the send for memory bandwidth) off the fetch path: the
producer's send is then a plain ``sendmsg`` from page memory (``loadtest/bench_p2p`` prints the
figures).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import IntegrityError
from kvtier.p2p.frames import MAX_PAGE_NONCE, WRAPPED_PAGE_KEY_BYTES
from kvtier.p2p.layout import LayoutFingerprint

PROOF_BYTES = 32
TAG_BYTES = 16
_KEY_BYTES = 32
PAGE_KEY_BYTES = 32
_DOMAIN = b"kvtier-p2p/v3\x00"
_NONCE = struct.Struct(">IQ")
_SESSION_NONCES = 0
_PAGE_NONCES = 1
"""Nonce prefixes: session keys and page keys are different keys; distinct prefixes anyway."""
_WRAP_NONCE = bytes(12)
"""The wrap key encrypts exactly one message (the page key), so a fixed nonce is unique."""
_WRAP_AAD = b"kvtier page key"
_MAX_SEQ = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Transcript:
    """What both ends said in the handshake; the proofs and the keys are bound to all of it."""

    version: int
    server_node_id: str
    client_node_id: str
    fingerprint: LayoutFingerprint
    server_nonce: bytes
    client_nonce: bytes

    def digest(self) -> bytes:
        fields = [
            self.version,
            self.server_node_id,
            self.client_node_id,
            self.fingerprint.to_wire(),
            self.server_nonce,
            self.client_nonce,
        ]
        return hashlib.sha256(_DOMAIN + msgpack.packb(fields, use_bin_type=True)).digest()


@dataclass(frozen=True, slots=True)
class SessionSecrets:
    """Proofs and per-direction keys of one session, derived from the secret and transcript."""

    client_proof: bytes
    server_proof: bytes
    client_to_server: bytes
    server_to_client: bytes
    page_key_wrap: bytes
    """Encrypts the producer's page key in ``welcome`` (used once per session)."""

    @classmethod
    def derive(cls, secret: bytes | None, transcript: Transcript) -> SessionSecrets:
        """Without a secret (loopback-only mode) the keys come from the nonces alone: they
        detect corruption, not attackers; any local process is trusted then."""
        salt = transcript.server_nonce + transcript.client_nonce
        prk = hmac.new(salt, secret or b"", hashlib.sha256).digest()
        bound = transcript.digest()

        def expand(label: bytes) -> bytes:
            # One HKDF-Expand block (T(1)) is exactly the 32 bytes each output needs.
            return hmac.new(prk, label + b"\x00" + bound + b"\x01", hashlib.sha256).digest()

        return cls(
            expand(b"client proof"),
            expand(b"server proof"),
            expand(b"client to server"),
            expand(b"server to client"),
            expand(b"page key wrap"),
        )

    def wrap_page_key(self, page_key: bytes) -> bytes:
        """The producer's page key, encrypted and authenticated for this session only."""
        return AESGCM(self.page_key_wrap).encrypt(_WRAP_NONCE, page_key, _WRAP_AAD)

    def unwrap_page_key(self, wrapped: bytes) -> bytes:
        """The page key from ``welcome``; IntegrityError when it was not wrapped for us."""
        try:
            key = AESGCM(self.page_key_wrap).decrypt(_WRAP_NONCE, wrapped, _WRAP_AAD)
        except InvalidTag as exc:
            raise IntegrityError("page key failed authentication under the session key") from exc
        if len(wrapped) != WRAPPED_PAGE_KEY_BYTES or len(key) != PAGE_KEY_BYTES:
            raise IntegrityError(f"page key of {len(key)} bytes")
        return key


def proofs_match(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison of a handshake proof."""
    return hmac.compare_digest(expected, received)


class Sealer:
    """The sending end of one direction: tags each frame and payload under the next number."""

    __slots__ = ("_aead", "_seq")

    def __init__(self, key: bytes) -> None:
        if len(key) != _KEY_BYTES:
            raise ValueError(f"a session key has {_KEY_BYTES} bytes")
        self._aead = AESGCM(key)
        self._seq = 0

    def reserve(self) -> int:
        """The next sequence number (one per control frame)."""
        seq = self._seq
        if seq >= _MAX_SEQ:
            raise IntegrityError("session sequence numbers exhausted")
        self._seq = seq + 1
        return seq

    def tag(self, seq: int, data: bytes | bytearray | memoryview) -> bytes:
        """The MAC of ``data`` at ``seq`` (a number from :meth:`reserve`, used once)."""
        return self._aead.encrypt(_NONCE.pack(_SESSION_NONCES, seq), b"", data)


class Opener:
    """The receiving end of one direction: verifies each frame and payload in order."""

    __slots__ = ("_aead", "_seq")

    def __init__(self, key: bytes) -> None:
        if len(key) != _KEY_BYTES:
            raise ValueError(f"a session key has {_KEY_BYTES} bytes")
        self._aead = AESGCM(key)
        self._seq = 0

    def verify(
        self, data: bytes | bytearray | memoryview, tag: bytes | memoryview, what: str
    ) -> None:
        """Raise :class:`IntegrityError` unless ``tag`` is the MAC of ``data`` at the next
        number; the number is consumed either way (the connection is dropped on failure)."""
        seq = self.skip()
        try:
            self._aead.decrypt(_NONCE.pack(_SESSION_NONCES, seq), bytes(tag), data)
        except InvalidTag as exc:
            raise IntegrityError(f"{what} failed authentication under the session key") from exc

    def skip(self) -> int:
        """Consume the next number without verifying it."""
        seq = self._seq
        if seq >= _MAX_SEQ:
            raise IntegrityError("session sequence numbers exhausted")
        self._seq = seq + 1
        return seq


@dataclass(frozen=True, slots=True)
class PageTag:
    """A page's MAC under its producer's page key (computed once per page write)."""

    nonce: int
    """The page key's nonce counter value this tag used (unique per tag under the key)."""
    mac: bytes


class PageSealer:
    """A producer's page key: tags pages (any thread; each call uses a fresh nonce)."""

    __slots__ = ("_aead", "_nonces", "key")

    def __init__(self, key: bytes | None = None) -> None:
        """``key``: for tests; a producer draws a random one (never stored, never reused)."""
        self.key = os.urandom(PAGE_KEY_BYTES) if key is None else key
        if len(self.key) != PAGE_KEY_BYTES:
            raise ValueError(f"a page key has {PAGE_KEY_BYTES} bytes")
        self._aead = AESGCM(self.key)
        # next() on itertools.count is atomic in CPython: concurrent taggers get distinct values.
        self._nonces = itertools.count()

    def tag(self, page: bytes | bytearray | memoryview) -> PageTag:
        nonce = next(self._nonces)
        if nonce > MAX_PAGE_NONCE:
            raise IntegrityError("page key nonces exhausted")
        return PageTag(nonce, self._aead.encrypt(_NONCE.pack(_PAGE_NONCES, nonce), b"", page))


class PageOpener:
    """A consumer's copy of one producer's page key (from the session's ``welcome``)."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        if len(key) != PAGE_KEY_BYTES:
            raise ValueError(f"a page key has {PAGE_KEY_BYTES} bytes")
        self._aead = AESGCM(key)

    def verify(self, page: bytes | bytearray | memoryview, tag: PageTag, what: str) -> None:
        """Raise :class:`IntegrityError` unless ``tag`` is the page key's MAC of ``page``."""
        if not 0 <= tag.nonce <= MAX_PAGE_NONCE:
            raise IntegrityError(f"{what} has an out-of-range page nonce")
        try:
            self._aead.decrypt(_NONCE.pack(_PAGE_NONCES, tag.nonce), tag.mac, page)
        except InvalidTag as exc:
            raise IntegrityError(f"{what} failed authentication under the page key") from exc
