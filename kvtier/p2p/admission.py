"""Who may start a P2P handshake now, and the producer server's counters.

Before a peer has proven the shared secret it can cost the server only a bounded handshake:

- a per-peer (source address) token bucket of handshake attempts: ``handshake_burst`` at once,
  refilled at ``handshake_rate_per_s``; a handshake that authenticates gives its token back, so
  a legitimate consumer is never throttled by its own reconnects;
- at most ``max_pending_handshakes_per_peer`` unauthenticated connections per address: one
  more from that address is closed on accept;
- at most ``max_pending_handshakes`` in all: a new connection past it *evicts* the oldest
  pending connection of the address that holds the most (the oldest of all on a tie), instead of
  being refused. Refusing the newcomer let a few addresses (4 x 32 silent connections, each
  re-opened as its deadline closed it) keep every slot and starve every legitimate peer; with
  eviction an address can only displace the busiest one, which is never a peer with a single
  handshake while any address holds more, and a legitimate handshake completes in a round trip,
  long before it becomes the oldest of ``max_pending_handshakes``;
- each of them reads at most a few KiB (:data:`~kvtier.p2p.frames.HANDSHAKE_MAX_FRAME_BYTES`)
  within ``handshake_timeout_s``: the deadline for the peer's first (and only) frame.

Refusals and evictions are counted here, never logged one by one. The bucket table is bounded
(least recently seen addresses are forgotten first), so many source addresses cannot grow it
either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvtier.token_bucket import TokenBuckets

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
    """Connections closed on accept: per-peer rate limit or the per-peer pending cap."""
    evicted_total: int
    """Unauthenticated connections closed to make room for a new one (``max_pending_handshakes``
    reached): the oldest of the address holding the most."""
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

    def snapshot(self, handshakes: int, sessions: int, evicted_total: int) -> ServerStats:
        return ServerStats(
            handshakes,
            sessions,
            self.accepted_total,
            self.authenticated_total,
            self.refused_total,
            self.busy_total,
            self.throttled_total,
            evicted_total,
            self.handshake_failures_total,
            self.protocol_errors_total,
            self.integrity_failures_total,
        )


class Evictable(Protocol):
    def evict(self) -> None:
        """Close this pending connection now (it may be called before it ever ran)."""


C = TypeVar("C", bound=Evictable)


class HandshakeAdmission(Generic[C]):
    """Per-peer token buckets, pending-handshake caps and eviction (one event loop; not
    thread-safe). ``C``: the server's handle of one pending connection."""

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
        self._max_pending = max_pending
        self._max_pending_per_peer = max_pending_per_peer
        self._buckets = TokenBuckets(
            rate_per_s, float(burst), max_keys=max_tracked_peers, clock=clock
        )
        self._pending: dict[str, dict[C, int]] = {}
        """Per address, its pending connections (oldest first) and the order they came in."""
        self._arrivals = 0
        self.pending_total = 0
        self.evicted_total = 0

    def begin(self, peer: str, conn: C) -> str | None:
        """Admit ``conn``, a new connection from ``peer`` (a source address), or say why not.
        When ``max_pending`` are pending already, one of them is evicted (``evict()`` is called
        on it, and it is no longer pending)."""
        mine = self._pending.get(peer)
        if mine is not None and len(mine) >= self._max_pending_per_peer:
            return "too many handshakes in progress from this peer"
        if not self._buckets.take(peer):
            return "handshake rate limit"
        if self.pending_total >= self._max_pending:
            self._evict_one()
        self._pending.setdefault(peer, {})[conn] = self._arrivals
        self._arrivals += 1
        self.pending_total += 1
        return None

    def end(self, peer: str, conn: C, *, authenticated: bool) -> None:
        """The handshake ``begin`` admitted is over (a no-op for an evicted one, counted when
        it was evicted); an authenticated one returns its token."""
        mine = self._pending.get(peer)
        if mine is not None and mine.pop(conn, None) is not None:
            self.pending_total -= 1
            if not mine:
                del self._pending[peer]
        if authenticated:
            self._buckets.give_back(peer)

    def _evict_one(self) -> None:
        """The oldest connection of the address with the most pending ones (oldest first on a
        tie) goes. A scan of at most ``max_pending`` addresses, and only when the set is full."""
        peer, mine = max(
            self._pending.items(), key=lambda item: (len(item[1]), -next(iter(item[1].values())))
        )
        conn = next(iter(mine))
        del mine[conn]
        if not mine:
            del self._pending[peer]
        self.pending_total -= 1
        self.evicted_total += 1
        conn.evict()
