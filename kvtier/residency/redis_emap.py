"""Engine-hash maps of a Redis index's nodes: this replica's copy, the shared one in Redis.

The writer of a node's event stream keeps the node's :class:`EngineHashMap` here and writes
every change through to ``{tag}:emap:<node>`` (as ``M``/``D``/``X`` operations of the same
apply call). Engine hashes its copy lacks (it took the stream over, or joined late) are read
from Redis before a batch is translated, so removals of blocks another replica stored resolve.
After a failed write the node is resynced: the shared map is merged in (except what this
replica dropped itself, or everything after a failed forget or clear) and the node rewritten.
Entries a map evicts to stay within its block budget are deleted from the shared map by the
same apply call, like removed ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from kvtier.errors import ResidencyUnavailable
from kvtier.events.types import BlockRemoved, BlockStored, EngineBlockHash, EventBatch
from kvtier.keys import BlockHasher
from kvtier.residency.redis_client import RedisClient
from kvtier.residency.redis_layout import (
    ModelKeys,
    emap_value,
    engine_field,
    parse_emap_value,
    parse_engine_field,
)
from kvtier.residency.translate import (
    DEFAULT_MAX_BLOCKS_PER_NODE,
    ClearOp,
    EngineHashMap,
    ResidencyOp,
    TranslateStats,
)
from kvtier.residency.types import NodeId

MapWrite = list[Any]
"""One engine-hash map operation of apply.lua (``X``, ``M field value``, ``D field``)."""


class SharedEngineMaps:
    def __init__(
        self,
        hasher: BlockHasher,
        group_idx: int,
        redis: RedisClient,
        keys: ModelKeys,
        read: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]],
        *,
        max_blocks_per_node: int = DEFAULT_MAX_BLOCKS_PER_NODE,
    ) -> None:
        """``read`` runs one Redis read under the index's apply deadline;
        ``max_blocks_per_node``: each map's budget (:mod:`kvtier.residency.translate`)."""
        self._hasher = hasher
        self._group = group_idx
        self._max_blocks = max_blocks_per_node
        self._redis = redis
        self._keys = keys
        self._read = read
        self._maps: dict[NodeId, EngineHashMap] = {}
        self._resync: set[NodeId] = set()
        """Nodes whose next apply rewrites them whole (an earlier write may be lost)."""
        self._wipe: set[NodeId] = set()
        """Nodes whose forget or clear may not have reached Redis: their rewrite starts from
        this replica's map alone."""
        self._dropped: dict[NodeId, set[bytes]] = {}
        """Engine-hash map fields whose drop may not have reached Redis, per node."""

    def stats(self, node: NodeId) -> TranslateStats:
        m = self._maps.get(node)
        return m.stats if m is not None else TranslateStats()

    def failed(self, touched: set[NodeId], tails: list[tuple[NodeId, list[MapWrite]]]) -> None:
        """A write of ``touched`` failed: resync them; remember what the shared map missed."""
        self._resync |= touched
        for node, tail in tails:
            for extra in tail:
                if extra[0] == b"X":
                    self._wipe.add(node)
                elif extra[0] == b"D":
                    self._dropped.setdefault(node, set()).add(extra[1])

    def written(self, touched: set[NodeId]) -> None:
        self._resync -= touched
        self._wipe -= touched
        for node in touched:
            self._dropped.pop(node, None)

    def forgetting(self, node: NodeId) -> None:
        """``node`` is being forgotten: until that succeeds, its next write starts afresh."""
        self._maps.pop(node, None)
        self._resync.add(node)
        self._wipe.add(node)

    def forgotten(self, node: NodeId) -> None:
        self._resync.discard(node)
        self._wipe.discard(node)

    def clear(self) -> None:
        self._maps.clear()

    async def translate(
        self, node: NodeId, batch: object
    ) -> tuple[list[ResidencyOp], list[MapWrite]]:
        """Residency operations and engine-hash map writes for ``batch``. Engine hashes this
        replica's map lacks are read from the shared map first (a replica that took over the
        node's stream resolves removals of blocks another replica stored)."""
        if not isinstance(batch, EventBatch):
            raise TypeError(f"expected an EventBatch, got {type(batch).__name__}")
        emap = self._maps.get(node)
        if emap is None:
            emap = self._maps[node] = EngineHashMap(
                self._hasher, self._group, max_blocks=self._max_blocks
            )
        try:
            if node in self._resync:
                await self._merge_shared_map(node, emap)
            else:
                await self._load_unknown(node, emap, batch)
        except ResidencyUnavailable:
            emap.translate(batch)  # not lost: the resync rewrites it
            raise
        if node in self._resync:
            emap.translate(batch)
            tail: list[MapWrite] = [[b"X"]]
            tail += [[b"M", engine_field(h), emap_value(m, hs)] for h, m, hs in emap.entries()]
            return [ClearOp(), *emap.snapshot()], tail
        ops = emap.translate(batch)
        tail = []
        touched: dict[EngineBlockHash, None] = {}
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                touched.update(dict.fromkeys(event.block_hashes))
            else:
                tail = [[b"X"]]
        touched.update(dict.fromkeys(emap.evicted))  # over the node's budget: deleted
        for h in touched:
            entry = emap.entry(h)
            if entry is None:
                tail.append([b"D", engine_field(h)])
            else:
                tail.append([b"M", engine_field(h), emap_value(*entry)])
        return ops, tail

    async def _merge_shared_map(self, node: NodeId, emap: EngineHashMap) -> None:
        """Before a resync: entries another replica wrote that this one lacks (not those it
        dropped itself in a write that failed, and none after a failed forget or clear)."""
        if node in self._wipe:
            return
        shared: dict[bytes, bytes] = await self._read(
            lambda: self._redis.hgetall(self._keys.emap(node))
        )
        dropped = self._dropped.get(node, set())
        for field, value in shared.items():
            h = parse_engine_field(field)
            if field not in dropped and emap.entry(h) is None:
                emap.load(h, *parse_emap_value(value))

    async def _load_unknown(self, node: NodeId, emap: EngineHashMap, batch: EventBatch) -> None:
        unknown = sorted(emap.unknown(batch), key=repr)
        if not unknown:
            return
        fields = [engine_field(h) for h in unknown]
        got: list[Any] = await self._read(lambda: self._redis.hmget(self._keys.emap(node), fields))
        for h, value in zip(unknown, got, strict=True):
            if value:
                emap.load(h, *parse_emap_value(value))
