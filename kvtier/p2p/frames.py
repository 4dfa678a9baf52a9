"""P2P wire frames: pure encoding and decoding, no I/O.

Every control frame is ``length (uint32 big-endian) ‖ msgpack map`` with a ``type`` field. The
handshake frames (``hello``, ``auth``, ``welcome``, ``refuse``) travel before authentication
and are capped at :data:`HANDSHAKE_MAX_FRAME_BYTES`. Every later frame is *sealed*: the length
counts the msgpack body plus a 16-byte MAC under the session key (:mod:`kvtier.p2p.sealing`)
that follows the body. A ``blocks`` frame announces up to :data:`MAX_BLOCKS_PER_FRAME` pages,
each as ``[key, nbytes, mac, nonce]``, and is followed on the wire by their raw payloads, back
to back in that order (not part of the frame). Each payload is authenticated by its entry's
``mac`` and ``nonce``: the page's tag under the producer's page key, computed once per page
write and sent in this session-MACed header (:mod:`kvtier.p2p.sealing`). One header per batch
of pages, not per page: the producer writes header and payloads with one ``sendmsg`` and the
consumer reads them with ``recvmsg_into`` straight into the reserved pages. Types:

=============  ==========================  ====================================================
type           direction                   fields
=============  ==========================  ====================================================
``hello``      server → client, first      ``version, node_id, fingerprint, nonce, auth``
``auth``       client → server             ``version, node_id, fingerprint, nonce, mac``
                                           (the client's proof over the transcript)
``welcome``    server → client             ``mac`` (the server's proof over the transcript),
                                           ``page_key`` (the producer's page key, encrypted
                                           under the session's wrap key)
``refuse``     either → other, then close  ``reason``
``fetch``      consumer → producer         ``kv_request_id, keys, deadline_ms``
``blocks``     producer → consumer         ``blocks``: 1..64 entries ``[key, nbytes, mac, nonce]``
``fail``       producer → consumer         ``kv_request_id, keys, reason``
``done``       consumer → producer         ``kv_request_id``
``release``    anyone → producer           ``kv_request_id``
``offer``      puller → holder             ``keys`` (symmetric pull, :mod:`kvtier.p2p.offer`)
``offered``    holder → puller             ``kv_request_id`` (None when nothing is held),
                                           ``num_held``
=============  ==========================  ====================================================

:func:`decode_frame` validates every field's type and bound and raises
:class:`kvtier.errors.ProtocolError` for anything else, so the I/O layers never see a
malformed frame.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import msgpack

from kvtier.errors import ProtocolError
from kvtier.keys import OFFLOAD_KEY_BYTES, OffloadKey
from kvtier.p2p.layout import LayoutFingerprint

PROTOCOL_VERSION = 4
"""v4: one ``blocks`` header per batch of pages (v3: a ``block`` header per page; v3 added
payload tags under a per-producer page key, computed once per page)."""
LENGTH_PREFIX = struct.Struct(">I")
NONCE_BYTES = 32
PROOF_BYTES = 32
PAYLOAD_MAC_BYTES = 16
WRAPPED_PAGE_KEY_BYTES = 48
"""A 32-byte page key encrypted with AES-GCM (16-byte tag); see kvtier.p2p.sealing."""
MAX_PAGE_NONCE = (1 << 64) - 1
HANDSHAKE_MAX_FRAME_BYTES = 4096
"""Cap on a frame before authentication: nothing larger is allocated for an unknown peer."""
MAX_ID_CHARS = 128
MAX_REASON_CHARS = 1024
MAX_PAYLOAD_BYTES = 1 << 31
MAX_BLOCKS_PER_FRAME = 64
"""Pages one ``blocks`` frame may announce (its header stays a few KiB)."""

KvRequestId = NewType("KvRequestId", str)
"""The id the proxy gives a producer/consumer pair (128-bit random, hex); names the supply."""

PeerNodeId = NewType("PeerNodeId", str)
"""A worker's node id as it announces itself in the handshake."""


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    node_id: PeerNodeId
    fingerprint: LayoutFingerprint
    nonce: bytes
    auth: bool


@dataclass(frozen=True, slots=True)
class Auth:
    version: int
    node_id: PeerNodeId
    fingerprint: LayoutFingerprint
    nonce: bytes
    mac: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    mac: bytes
    page_key: bytes
    """The producer's page key, wrapped for this session (``SessionSecrets.wrap_page_key``)."""


@dataclass(frozen=True, slots=True)
class Refuse:
    reason: str


@dataclass(frozen=True, slots=True)
class Fetch:
    kv_request_id: KvRequestId
    keys: tuple[OffloadKey, ...]
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """One page of a :class:`BlockBatch`: its key, payload size and tag."""

    key: OffloadKey
    nbytes: int
    mac: bytes
    """The payload's MAC under the producer's page key (``PageTag.mac``)."""
    nonce: int = 0
    """The page key nonce of that MAC (``PageTag.nonce``)."""


@dataclass(frozen=True, slots=True)
class BlockBatch:
    """A ``blocks`` frame: the payloads of ``blocks`` follow it on the wire, in order."""

    blocks: tuple[BlockHeader, ...]

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)


@dataclass(frozen=True, slots=True)
class Fail:
    kv_request_id: KvRequestId
    keys: tuple[OffloadKey, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Done:
    kv_request_id: KvRequestId


@dataclass(frozen=True, slots=True)
class Release:
    kv_request_id: KvRequestId


@dataclass(frozen=True, slots=True)
class Offer:
    """Which leading run of ``keys`` does the holder hold? (:mod:`kvtier.p2p.offer`)"""

    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True, slots=True)
class Offered:
    """The holder pinned ``keys[:num_held]`` of the offer as a supply under ``kv_request_id``."""

    kv_request_id: KvRequestId | None
    num_held: int


Frame = (
    Hello | Auth | Welcome | Refuse | Fetch | BlockBatch | Fail | Done | Release | Offer | Offered
)
HandshakeFrame = Hello | Auth | Welcome | Refuse
HANDSHAKE_FRAMES = (Hello, Auth, Welcome, Refuse)


def encode_frame(frame: Frame) -> bytes:
    """Length prefix and msgpack body of one unsealed (handshake) frame."""
    packed = encode_body(frame)
    return LENGTH_PREFIX.pack(len(packed)) + packed


def encode_body(frame: Frame) -> bytes:
    """The msgpack body of one control frame (no length prefix)."""
    body: dict[str, object]
    match frame:
        case Hello():
            body = {
                "type": "hello",
                "version": frame.version,
                "node_id": frame.node_id,
                "fingerprint": frame.fingerprint.to_wire(),
                "nonce": frame.nonce,
                "auth": frame.auth,
            }
        case Auth():
            body = {
                "type": "auth",
                "version": frame.version,
                "node_id": frame.node_id,
                "fingerprint": frame.fingerprint.to_wire(),
                "nonce": frame.nonce,
                "mac": frame.mac,
            }
        case Welcome():
            body = {"type": "welcome", "mac": frame.mac, "page_key": frame.page_key}
        case Refuse():
            body = {"type": "refuse", "reason": frame.reason}
        case Fetch():
            body = {
                "type": "fetch",
                "kv_request_id": frame.kv_request_id,
                "keys": list(frame.keys),
                "deadline_ms": frame.deadline_ms,
            }
        case BlockBatch():
            body = {
                "type": "blocks",
                "blocks": [[b.key, b.nbytes, b.mac, b.nonce] for b in frame.blocks],
            }
        case Fail():
            body = {
                "type": "fail",
                "kv_request_id": frame.kv_request_id,
                "keys": list(frame.keys),
                "reason": frame.reason,
            }
        case Done():
            body = {"type": "done", "kv_request_id": frame.kv_request_id}
        case Release():
            body = {"type": "release", "kv_request_id": frame.kv_request_id}
        case Offer():
            body = {"type": "offer", "keys": list(frame.keys)}
        case Offered():
            body = {
                "type": "offered",
                "kv_request_id": frame.kv_request_id,
                "num_held": frame.num_held,
            }
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def frame_length(prefix: bytes | bytearray | memoryview, max_frame_bytes: int) -> int:
    """The body length announced by a 4-byte prefix; ProtocolError when zero or oversize."""
    (n,) = LENGTH_PREFIX.unpack(prefix)
    if n == 0 or n > max_frame_bytes:
        raise ProtocolError(f"frame length {n} outside 1..{max_frame_bytes}")
    return int(n)


def decode_frame(body: bytes | bytearray | memoryview) -> Frame:
    """One frame from its msgpack body (without the length prefix)."""
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for garbage
        raise ProtocolError(f"frame body is not msgpack: {type(exc).__name__}") from exc
    if not isinstance(raw, dict):
        raise ProtocolError("frame body is not a map")
    kind = raw.get("type")
    if kind == "blocks":
        return BlockBatch(_blocks(raw.get("blocks")))
    if kind == "fetch":
        return Fetch(_rid(raw), _keys(raw.get("keys")), _int(raw, "deadline_ms", 0, 3_600_000))
    if kind == "fail":
        return Fail(_rid(raw), _keys(raw.get("keys")), _str(raw, "reason", MAX_REASON_CHARS))
    if kind == "done":
        return Done(_rid(raw))
    if kind == "release":
        return Release(_rid(raw))
    if kind == "offer":
        return Offer(_keys(raw.get("keys")))
    if kind == "offered":
        num_held = _int(raw, "num_held", 0, MAX_PAYLOAD_BYTES)
        rid = _rid(raw) if raw.get("kv_request_id") is not None else None
        if (rid is None) != (num_held == 0):
            raise ProtocolError("offered: a kv_request_id exactly when num_held > 0")
        return Offered(rid, num_held)
    if kind == "hello":
        return Hello(
            _int(raw, "version", 0, 1 << 16),
            PeerNodeId(_str(raw, "node_id", MAX_ID_CHARS)),
            LayoutFingerprint.from_wire(raw.get("fingerprint")),
            _bytes(raw, "nonce", NONCE_BYTES),
            _bool(raw, "auth"),
        )
    if kind == "auth":
        return Auth(
            _int(raw, "version", 0, 1 << 16),
            PeerNodeId(_str(raw, "node_id", MAX_ID_CHARS)),
            LayoutFingerprint.from_wire(raw.get("fingerprint")),
            _bytes(raw, "nonce", NONCE_BYTES),
            _bytes(raw, "mac", PROOF_BYTES),
        )
    if kind == "welcome":
        return Welcome(
            _bytes(raw, "mac", PROOF_BYTES), _bytes(raw, "page_key", WRAPPED_PAGE_KEY_BYTES)
        )
    if kind == "refuse":
        return Refuse(_str(raw, "reason", MAX_REASON_CHARS))
    raise ProtocolError(f"unknown frame type {str(kind)[:40]!r}")


def _int(raw: dict[str, object], name: str, lo: int, hi: int) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"field {name} must be an integer in [{lo}, {hi}]")
    return value


def _str(raw: dict[str, object], name: str, max_chars: int) -> str:
    value = raw.get(name)
    if not isinstance(value, str) or len(value) > max_chars:
        raise ProtocolError(f"field {name} must be a string of at most {max_chars} chars")
    return value


def _bool(raw: dict[str, object], name: str) -> bool:
    value = raw.get(name)
    if not isinstance(value, bool):
        raise ProtocolError(f"field {name} must be a boolean")
    return value


def _bytes(raw: dict[str, object], name: str, size: int) -> bytes:
    value = raw.get(name)
    if not isinstance(value, bytes) or len(value) != size:
        raise ProtocolError(f"field {name} must be {size} bytes")
    return value


def _blocks(value: object) -> tuple[BlockHeader, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_BLOCKS_PER_FRAME:
        raise ProtocolError(f"blocks must be a list of 1..{MAX_BLOCKS_PER_FRAME} entries")
    return tuple(_block(entry) for entry in value)


def _block(entry: object) -> BlockHeader:
    if not isinstance(entry, list) or len(entry) != 4:
        raise ProtocolError("a block entry must be [key, nbytes, mac, nonce]")
    fields = {"nbytes": entry[1], "mac": entry[2], "nonce": entry[3]}
    return BlockHeader(
        _key(entry[0]),
        _int(fields, "nbytes", 1, MAX_PAYLOAD_BYTES),
        _bytes(fields, "mac", PAYLOAD_MAC_BYTES),
        _int(fields, "nonce", 0, MAX_PAGE_NONCE),
    )


def _rid(raw: dict[str, object]) -> KvRequestId:
    value = _str(raw, "kv_request_id", MAX_ID_CHARS)
    if not value:
        raise ProtocolError("kv_request_id must not be empty")
    return KvRequestId(value)


def _key(value: object) -> OffloadKey:
    if not isinstance(value, bytes) or len(value) != OFFLOAD_KEY_BYTES:
        raise ProtocolError(f"a key must be {OFFLOAD_KEY_BYTES} bytes")
    return OffloadKey(value)


def _keys(value: object) -> tuple[OffloadKey, ...]:
    if not isinstance(value, list):
        raise ProtocolError("keys must be a list")
    return tuple(_key(k) for k in value)


def as_keys(keys: Sequence[bytes]) -> tuple[OffloadKey, ...]:
    """Validate caller-supplied keys before they go on the wire (ValueError if malformed)."""
    try:
        return tuple(_key(k) for k in keys)
    except ProtocolError as exc:
        raise ValueError(str(exc)) from exc
