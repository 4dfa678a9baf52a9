"""The read side of the Redis residency index: a prompt's match, in plain commands.

Writes go through Lua scripts (:mod:`.redis_index`); a match reads with plain commands: per
chunk of up to ``max_blocks_per_read`` blocks, the Redis clock, the names epoch and one
``HMGET`` of the blocks' 8-byte ids from the residency hash and one from the predictions hash,
packed into one round trip on a single node (a cluster's clock comes from the model's node
through ``clock.lua``). The walk (:mod:`.redis_walk`, integer ANDs) runs here, over the first
block's holders that are among the caller's candidates, and the next chunk is read only while
one still matches. Slot names are cached until the epoch moves (a slot was retired or handed
back); a slot that names no node is retired and ignored.

A caller may send read-only script calls of its own with the first chunk (``riders``: the
router's load read), so a decision costs one round trip, not two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvtier.keys import BlockHash
from kvtier.residency.redis_client import (
    RedisClient,
    ScriptCall,
    packed_command,
    packed_hmget,
    packed_script_call,
    run_packed,
)
from kvtier.residency.redis_layout import BLOCK_ID_BYTES, ModelKeys, script_source
from kvtier.residency.redis_walk import Walk
from kvtier.residency.types import Match, NodeId

_Chunk = tuple[int, int, list[bytes | None], list[bytes | None]]
"""The Redis clock (ms), the names epoch, the blocks' residency and prediction values."""


class RedisMatcher:
    """Matches prompts against one model's residency hashes (see the module docstring)."""

    def __init__(self, client: RedisClient, keys: ModelKeys, max_blocks_per_read: int) -> None:
        self._redis = client
        self._cluster = isinstance(client, RedisCluster)
        self._keys = keys
        self._limit = max_blocks_per_read
        self._clock = client.register_script(script_source("clock.lua"))
        self._names_cache: dict[int, str | None] = {}
        self._names_epoch = -1
        self.calls = 0
        """Chunk reads and name reads sent."""

    async def match(
        self,
        hashes: Sequence[BlockHash],
        among: Collection[NodeId] | None,
        riders: Sequence[ScriptCall] = (),
    ) -> tuple[dict[NodeId, Match], list[Any]]:
        """The match of ``hashes`` (not empty), and the replies of ``riders`` (read-only
        script calls sent with the first chunk)."""
        limit = self._limit
        walk: Walk | None = None
        epoch = 0
        start = 0
        rode: list[Any] = []
        while start < len(hashes):
            part = hashes[start : start + limit]
            (now_ms, epoch, rv, pv), got = await self._read_chunk(part, riders)
            if walk is None:
                rode, riders = got, ()
                walk = Walk(now_ms)
                if among is not None:
                    first = walk.first_slots(rv[0], pv[0])
                    keep = await self._candidates(epoch, first, among) if first else []
                    if not keep:
                        return {}, rode
                    walk.keep(keep)
            if not walk.feed(rv, pv):
                break
            start += len(part)
        lengths = walk.result() if walk is not None else {}
        names = await self._names(epoch, list(lengths))
        out: dict[NodeId, Match] = {}
        for slot, (g, c, t, p) in lengths.items():
            name = names.get(slot)
            if name is not None:  # None: a retired slot awaiting its sweep
                out[NodeId(name)] = Match(gpu=g, cpu=c, total=t, predicted=p)
        return out, rode

    async def _read_chunk(
        self, part: Sequence[BlockHash], riders: Sequence[ScriptCall]
    ) -> tuple[_Chunk, list[Any]]:
        """One chunk's values (``HMGET`` of 8-byte fields: no script, no key per block) and
        the riders' replies, in one round trip on a single node."""
        k = self._keys
        ids = [h[:BLOCK_ID_BYTES] for h in part]
        self.calls += 1
        if self._cluster:
            return await self._read_chunk_cluster(ids, riders)
        assert isinstance(self._redis, Redis)
        data = (
            packed_command(b"TIME")
            + packed_command(b"GET", k.epoch)
            + packed_hmget(k.res, ids, BLOCK_ID_BYTES)
            + packed_hmget(k.pred, ids, BLOCK_ID_BYTES)
            + b"".join(map(packed_script_call, riders))
        )
        scripts = [s for s, _, _ in riders]
        replies = await run_packed(self._redis, data, 4 + len(riders), scripts=scripts)
        (sec, usec), epoch_raw, rv, pv = replies[:4]
        return (int(sec) * 1000 + int(usec) // 1000, int(epoch_raw or 0), rv, pv), replies[4:]

    async def _read_chunk_cluster(
        self, ids: list[bytes], riders: Sequence[ScriptCall]
    ) -> tuple[_Chunk, list[Any]]:
        """A cluster client pipelines no scripts: the riders run beside the chunk's reads."""
        k = self._keys

        async def chunk() -> _Chunk:
            now_ms, epoch = await self._clock(keys=[k.epoch])
            rv: list[bytes | None] = await self._redis.hmget(k.res, ids)  # type: ignore[assignment]
            pv: list[bytes | None] = await self._redis.hmget(k.pred, ids)  # type: ignore[assignment]
            return int(now_ms), int(epoch), rv, pv

        if not riders:
            return await chunk(), []
        got = await asyncio.gather(chunk(), *(s(keys=ks, args=a) for s, ks, a in riders))
        return got[0], list(got[1:])

    async def _candidates(
        self, epoch: int, slots: list[int], among: Collection[NodeId]
    ) -> list[int]:
        """Those of ``slots`` whose nodes are ``among`` the candidates."""
        names = await self._names(epoch, slots)
        wanted = among if isinstance(among, (set, frozenset, dict)) else set(among)
        return [s for s in slots if names.get(s) in wanted]

    async def _names(self, epoch: int, slots: list[int]) -> dict[int, str | None]:
        """Node names of ``slots``, cached while the names epoch stays (a retired or reused
        slot bumps it); one HMGET for slots not cached."""
        if epoch != self._names_epoch:
            self._names_cache.clear()
            self._names_epoch = epoch
        cache = self._names_cache
        missing = [s for s in slots if s not in cache]
        if missing:
            self.calls += 1
            got: list[Any] = await self._redis.hmget(self._keys.names, missing)
            for slot, name in zip(missing, got, strict=True):
                cache[slot] = name.decode() if name is not None else None
        return cache
