"""Who may start a P2P handshake now, and the producer server's counters.

Before a peer has proven the shared secret it can cost the server only a bounded handshake:

- a per-peer (source address) token bucket of handshake attempts: ``handshake_burst`` at once,
  refilled at ``handshake_rate_per_s``; a handshake that authenticates gives its token back, so
  a legitimate consumer is never throttled by its own reconnects;
- at most ``max_pending_handshakes_per_peer`` unauthenticated connections per address and
  ``max_pending_handshakes`` in all; more are closed on accept;
- each of them reads at most a few KiB (:data:`~kvtier.p2p.frames.HANDSHAKE_MAX_FRAME_BYTES`)
  within ``handshake_timeout_s``.

Refusals are counted here, never logged one by one. The bucket table is bounded (least recently
seen addresses are forgotten first), so many source addresses cannot grow it either.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

_MAX_TRACKED_PEERS = 4096


@dataclass(frozen=True, slots=True)
class ServerStats:
    """A snapshot of the producer server's connection counters (``*_total`` are monotonic)."""

    handshakes: int
    """Connections open now that have not authenticated yet."""
    sessions: int
    """Authenticated sessions open now (what ``max_connections`` bounds)."""
    accepted_total: int
    authenticated_total: int
    refused_total: int
    """Handshakes refused: version, fingerprint, failed proof, loopback-only, or no session
    slot left (see ``busy_total``)."""
    busy_total: int
    """Authenticated peers refused because ``max_connections`` sessions were open."""
    throttled_total: int
    """Connections closed on accept: per-peer rate limit or a pending-handshake cap."""
    handshake_failures_total: int
    """Handshakes that timed out, sent a malformed or oversize frame, or hung up."""
    protocol_errors_total: int
    """Authenticated sessions closed for a malformed, unexpected or unauthenticated frame."""
    integrity_failures_total: int
    """Of those, frames whose MAC did not verify (tampering, replay, reordering)."""


@dataclass(slots=True)
class ServerCounters:
    """The mutable counters behind :class:`ServerStats` (owned by one server)."""

    accepted_total: int = 0
    authenticated_total: int = 0
    refused_total: int = 0
    busy_total: int = 0
    throttled_total: int = 0
    handshake_failures_total: int = 0
    protocol_errors_total: int = 0
    integrity_failures_total: int = 0

    def snapshot(self, handshakes: int, sessions: int) -> ServerStats:
        return ServerStats(
            handshakes,
            sessions,
            self.accepted_total,
            self.authenticated_total,
            self.refused_total,
            self.busy_total,
            self.throttled_total,
            self.handshake_failures_total,
            self.protocol_errors_total,
            self.integrity_failures_total,
        )


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


class HandshakeAdmission:
    """Per-peer token buckets and pending-handshake caps (one event loop; not thread-safe)."""

    def __init__(
        self,
        *,
        rate_per_s: float,
        burst: int,
        max_pending: int,
        max_pending_per_peer: int,
        clock: Callable[[], float] = time.monotonic,
        max_tracked_peers: int = _MAX_TRACKED_PEERS,
    ) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._max_pending = max_pending
        self._max_pending_per_peer = max_pending_per_peer
        self._clock = clock
        self._max_tracked = max_tracked_peers
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._pending: dict[str, int] = {}
        self.pending_total = 0

    def begin(self, peer: str) -> str | None:
        """Admit one handshake from ``peer`` (a source address) now, or say why not."""
        if self.pending_total >= self._max_pending:
            return "too many handshakes in progress"
        if self._pending.get(peer, 0) >= self._max_pending_per_peer:
            return "too many handshakes in progress from this peer"
        bucket = self._bucket(peer)
        if bucket.tokens < 1.0:
            return "handshake rate limit"
        bucket.tokens -= 1.0
        self._pending[peer] = self._pending.get(peer, 0) + 1
        self.pending_total += 1
        return None

    def end(self, peer: str, *, authenticated: bool) -> None:
        """The handshake ``begin`` admitted is over; an authenticated one returns its token."""
        left = self._pending.get(peer, 0) - 1
        if left > 0:
            self._pending[peer] = left
        else:
            self._pending.pop(peer, None)
        self.pending_total = max(self.pending_total - 1, 0)
        if authenticated:
            bucket = self._bucket(peer)
            bucket.tokens = min(bucket.tokens + 1.0, self._burst)

    def _bucket(self, peer: str) -> _Bucket:
        now = self._clock()
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = _Bucket(self._burst, now)
            while len(self._buckets) > self._max_tracked:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
            elapsed = max(now - bucket.updated, 0.0)
            bucket.tokens = min(bucket.tokens + elapsed * self._rate, self._burst)
            bucket.updated = now
        return bucket
