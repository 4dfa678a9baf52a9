"""One writer per worker event stream when proxy replicas share a Redis index.

Every replica follows every worker's events, but only the holder of a worker's lease
(``{tag}:lease:<node>``, a TTL renewed every ``ttl_s / 3``) applies them; Redis refuses an apply
from anyone else (``NOTOWNER``), so a replica that paused past its lease cannot write late.
When the holder dies its lease expires and another replica takes it within ``ttl_s`` plus one
renewal period; the new holder resubscribes from the sequence after the last one applied (the
worker's replay socket fills the gap) and resolves removals through the engine-hash map shared
in Redis. A replica that leaves cleanly drops its leases at once.
"""

from __future__ import annotations

import logging

from kvtier.errors import ResidencyError
from kvtier.events import EventBatch
from kvtier.residency.redis_index import RedisIndex
from kvtier.residency.types import NodeId

logger = logging.getLogger(__name__)


class StreamLeases:
    def __init__(self, index: RedisIndex, replica: str, ttl_s: float) -> None:
        self._index = index
        index.writer = replica
        self.replica = replica
        self.ttl_s = ttl_s
        self._held: set[NodeId] = set()

    @property
    def renew_s(self) -> float:
        return self.ttl_s / 3

    def holds(self, node: NodeId) -> bool:
        return node in self._held

    @property
    def held(self) -> list[NodeId]:
        return sorted(self._held)

    def lost(self, node: NodeId) -> None:
        """Redis said another replica writes ``node`` (an apply was refused)."""
        if node in self._held:
            self._held.discard(node)
            logger.warning("KV events for %s: lease lost; another replica writes them", node)

    async def apply(self, node: NodeId, batch: EventBatch, seq: int) -> None:
        """Apply one batch of ``node``'s stream as its writer (refused by Redis otherwise)."""
        await self._index.apply(node, batch, seq=seq)

    async def take(self, node: NodeId) -> int | None:
        """Take or renew ``node``'s lease. Returns the sequence to follow from when this call
        took it (it was not held before), else None."""
        try:
            held, last = await self._index.lease(node, take=True, ttl_s=self.ttl_s)
        except ResidencyError as exc:
            logger.debug("KV events for %s: lease call failed: %s", node, exc)
            return None  # keep what we believe; the fence in Redis decides on apply
        if not held:
            self.lost(node)
            return None
        if node in self._held:
            return None
        self._held.add(node)
        logger.info("KV events for %s: this replica writes them from seq %d", node, last + 1)
        return last + 1

    async def drop(self, node: NodeId) -> None:
        if node not in self._held:
            return
        self._held.discard(node)
        try:
            await self._index.lease(node, take=False, ttl_s=self.ttl_s)
        except ResidencyError as exc:
            logger.info("KV events for %s: lease not dropped (%s); it expires", node, exc)
