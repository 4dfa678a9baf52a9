"""Typed errors of kvtier.

Hierarchy::

    KvtierError
    ├── InvalidTokensError        token ids that cannot be hashed (negative, too large, not ints)
    ├── EventDecodeError          a KV event payload that does not decode to an EventBatch
    ├── EventSecurityError        KV event CURVE keys missing, unreadable or unsupported
    ├── AnnouncementError         a worker announcement that does not decode (kvtier.announce)
    ├── ResidencyError            the residency index failed
    │   └── ResidencyUnavailable  the backing store (Redis) is down, slow or refused the call
    ├── OffloadError              the tiering manager was used against its contract
    │   ├── PoolExhausted         no page can be freed: the store is refused (and counted)
    │   ├── UnknownKey            a key that the pool or tier does not hold
    │   └── PageCopyError         a GPU↔host page copy job failed or missed its deadline
    └── P2PError                  peer transport failures
        ├── HandshakeRefused      version, fingerprint or authentication mismatch
        ├── ProtocolError         a malformed or unexpected frame
        │   └── IntegrityError    a frame or payload whose MAC under the session key fails
        └── FetchFailed           demanded blocks could not be delivered

Each boundary translates foreign exceptions into these (``raise X(...) from exc``).
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


class InvalidTokensError(KvtierError, ValueError):
    """Token ids that cannot be hashed."""


class EventDecodeError(KvtierError, ValueError):
    """A KV event payload that is not a valid EventBatch."""


class EventSecurityError(KvtierError):
    """KV event CURVE keys that are missing, unreadable or not supported by this libzmq (the
    message names the file, never a key)."""


class AnnouncementError(KvtierError, ValueError):
    """A worker announcement (registration message) that is malformed or over its limits; the
    message says which field, never the value."""


class ResidencyError(KvtierError):
    """The residency index failed."""


class ResidencyUnavailable(ResidencyError):
    """The index's backing store is down, slow past its deadline, or refused the call."""


class OffloadError(KvtierError):
    """The tiering manager was used against its contract."""


class PoolExhausted(OffloadError):
    """No page could be freed for a store; the store is refused and counted."""


class UnknownKey(OffloadError, KeyError):
    """A key that the pool or tier does not hold."""


class PageCopyError(OffloadError):
    """A GPU↔host page copy job failed or did not finish before its deadline."""


class P2PError(KvtierError):
    """Peer transport failure."""


class HandshakeRefused(P2PError):
    """The peer refused the handshake (version, layout fingerprint or authentication)."""


class ProtocolError(P2PError):
    """A malformed or unexpected frame."""


class IntegrityError(ProtocolError):
    """A frame or block payload whose MAC under the session key does not verify: tampered,
    forged, replayed, reordered or reflected. Nothing it carried is used."""


class FetchFailed(P2PError):
    """Demanded blocks could not be delivered."""
