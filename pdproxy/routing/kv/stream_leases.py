"""One writer per worker event stream when proxy replicas share a Redis index.

Every replica follows every worker's events, but only the holder of a worker's lease
(``{tag}:lease:<node>``, a TTL renewed every ``ttl_s / 3``) applies them; Redis refuses an apply
from anyone else (``NOTOWNER``), so a replica that paused past its lease cannot write late.
When the holder dies its lease expires and another replica takes it within ``ttl_s`` plus one
renewal period; the new holder resubscribes from the sequence after the last one applied (the
worker's replay socket fills the gap) and resolves removals through the engine-hash map shared
in Redis. A replica that leaves cleanly drops its leases at once.

Balance: each renewal learns how many replicas are live (their load heartbeats), and a replica
holds at most its share, ``ceil(streams / live replicas) + slack``: above it, it drops the
excess (the others take them on their next renewal: a takeover, with the gap replayed); at or
above it, it leaves free leases to replicas below theirs, and takes one only when it has been
free for a whole renewal period (no stream stays unwritten because the count was stale). So a
new replica takes its share within a few renewal periods, and the streams of one that left are
spread over the rest.
"""

from __future__ import annotations

import logging
import math

from kvtier.errors import ResidencyError
from kvtier.events import EventBatch
from kvtier.residency.redis_index import RedisIndex
from kvtier.residency.types import NodeId

logger = logging.getLogger(__name__)


class StreamLeases:
    def __init__(self, index: RedisIndex, replica: str, ttl_s: float, slack: int = 0) -> None:
        self._index = index
        index.writer = replica
        self.replica = replica
        self.ttl_s = ttl_s
        self.slack = slack
        self._held: set[NodeId] = set()
        self._live = 1
        """Live replicas as the last lease call saw them (at least this one)."""
        self._passed: set[NodeId] = set()
        """Free leases this replica left to others on the last renewal."""

    @property
    def renew_s(self) -> float:
        return self.ttl_s / 3

    def holds(self, node: NodeId) -> bool:
        return node in self._held

    @property
    def held(self) -> list[NodeId]:
        return sorted(self._held)

    def share(self, streams: int) -> int:
        """The most streams this replica should write, ``streams`` being followed."""
        return math.ceil(streams / max(self._live, 1)) + self.slack

    def lost(self, node: NodeId) -> None:
        """Redis said another replica writes ``node`` (an apply was refused)."""
        if node in self._held:
            self._held.discard(node)
            logger.warning("KV events for %s: lease lost; another replica writes them", node)

    async def apply(self, node: NodeId, batch: EventBatch, seq: int) -> None:
        """Apply one batch of ``node``'s stream as its writer (refused by Redis otherwise)."""
        await self._index.apply(node, batch, seq=seq)

    async def take(self, node: NodeId, streams: int | None = None) -> int | None:
        """Take or renew ``node``'s lease. Returns the sequence to follow from when this call
        took it (it was not held before), else None. With ``streams`` (how many this replica
        follows), a free lease is taken only below this replica's share, or once it stayed
        free for a renewal period."""
        free_too = True
        if streams is not None and node not in self._held:
            free_too = len(self._held) < self.share(streams) or node in self._passed
        try:
            held, last, live = await self._index.lease(
                node, take=True, ttl_s=self.ttl_s, free_too=free_too
            )
        except ResidencyError as exc:
            logger.debug("KV events for %s: lease call failed: %s", node, exc)
            return None  # keep what we believe; the fence in Redis decides on apply
        self._live = max(live, 1)
        if not held:
            self.lost(node)
            if free_too:
                self._passed.discard(node)
            else:
                self._passed.add(node)  # taken next time if no one else did meanwhile
            return None
        self._passed.discard(node)
        if node in self._held:
            return None
        self._held.add(node)
        logger.info("KV events for %s: this replica writes them from seq %d", node, last + 1)
        return last + 1

    async def balance(self, streams: int) -> list[NodeId]:
        """Drop the leases above this replica's share (the last ones by name, so replicas
        agree on which move); returns the nodes dropped."""
        excess = len(self._held) - self.share(streams)
        if excess <= 0:
            return []
        dropped = sorted(self._held)[-excess:]
        for node in dropped:
            logger.info("KV events for %s: handed over (this replica is above its share)", node)
            await self.drop(node)
        return dropped

    async def drop(self, node: NodeId) -> None:
        if node not in self._held:
            return
        self._held.discard(node)
        try:
            await self._index.lease(node, take=False, ttl_s=self.ttl_s)
        except ResidencyError as exc:
            logger.info("KV events for %s: lease not dropped (%s); it expires", node, exc)
