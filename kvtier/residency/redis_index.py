"""Residency index in Redis, shared by several proxies.

Layout (every key of a model under one hash tag, so a model lives in one Redis Cluster slot):
``{ns:model}:slots`` (hash node → slot 0..25), ``{ns:model}:retired`` (set of slots awaiting a
sweep), ``{ns:model}:nodes`` (set of known nodes), and per router block hash ``h`` (16 raw
bytes): ``{ns:model}:r:h`` = ``G + C·2^26`` where ``G`` / ``C`` are bitmasks of the slots
holding the block on GPU / CPU, and ``{ns:model}:p:h`` = the block's predictions, one 16-byte
entry per slot (slot, then its expiry in ms on the Redis clock), expiring with its
longest-lived prediction (``{ns:model}:plive`` with the longest-lived of all: without it,
``match`` skips prediction keys). Each live node owns one bit, so at most 26 nodes per model
are tracked at once.

Forgetting a node (or an ``AllBlocksCleared`` from it) retires its slot: ``match`` ignores
retired bits at once, and :meth:`RedisIndex.sweep` (run in the background when slots run
short) clears them from every key before the slot is handed out again. This plays the role
of node epochs: a restarted node's stale entries vanish in O(1).

Lua scripts (``*.lua`` beside this module), registered once per client (EVALSHA; reloaded if
Redis lost them): ``match`` walks the chain in one round trip, reading only: residency values
with MGET in chunks, prediction entries only for blocks a node still matching lacks, skipping
blocks whose values equal the previous block's, keeping a running AND of the masks per tier and
stopping at the first block that no node still matching holds or predicted; ``apply`` writes
one batch of translated operations; ``predict`` writes predictions with a TTL (dropping expired
entries it meets); ``forget`` retires a slot; ``sweep`` scrubs retired bits and entries.
Block keys are built inside the scripts from a prefix sharing the declared keys' hash tag;
hashes travel as one concatenated argument.

Every call runs under a deadline (``deadline_s``; ``apply_deadline_s`` for writes) with no
retries: a dead, paused or slow Redis raises :class:`kvtier.errors.ResidencyUnavailable` in
milliseconds, so the router can fall back to load-only routing. A failed ``apply`` marks the
node for a resync: the next successful one clears it in Redis and rewrites everything the
node's engine-hash map knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from importlib.resources import files
from typing import Any, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from redis.exceptions import RedisError

from kvtier.errors import ResidencyUnavailable
from kvtier.events.types import EventBatch, Medium
from kvtier.keys import BLOCK_HASH_BYTES, BlockHash, BlockHasher
from kvtier.residency.redis_client import RedisClient, bounded, connect, hash_tag
from kvtier.residency.translate import (
    ClearOp,
    EngineHashMap,
    ResidencyOp,
    StoreOp,
    TranslateStats,
)
from kvtier.residency.types import Match, NodeId

logger = logging.getLogger(__name__)

T = TypeVar("T")
_TIER = {Medium.GPU: b"G", Medium.CPU: b"C"}


class RedisIndexSettings(BaseSettings):
    """Connection and deadlines of :class:`RedisIndex` (env prefix ``KVTIER_RESIDENCY_``)."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_RESIDENCY_")

    url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL")
    namespace: str = Field(default="kvtier", description="first part of the per-model hash tag")
    deadline_s: float | None = Field(
        default=0.05,
        gt=0,
        description="deadline of match/predict/forget/nodes; None when the caller bounds each "
        "call itself (the router's store guard)",
    )
    apply_deadline_s: float = Field(default=0.5, gt=0, description="deadline of one apply call")
    max_connections: int = Field(default=64, gt=0, description="connection pool size")
    group_idx: int = Field(default=0, ge=0, description="KV-cache group whose events are indexed")


def _lua(name: str) -> str:
    return files("kvtier.residency").joinpath(name).read_text(encoding="utf-8")


class RedisIndex:
    """:class:`kvtier.residency.types.ResidencyIndex` in Redis (see the module docstring)."""

    SWEEP_AFTER_RETIRED = 8
    """Start a background sweep once this many slots are retired."""

    def __init__(
        self,
        hasher: BlockHasher,
        settings: RedisIndexSettings,
        client: RedisClient | None = None,
        *,
        close_client: bool = False,
    ) -> None:
        """``client`` (from :func:`~kvtier.residency.redis_client.connect`) is shared with the
        caller, which closes it unless ``close_client``; without one the index connects to
        ``settings.url`` and closes its own client."""
        self._hasher = hasher
        self._settings = settings
        tag = hash_tag(settings.namespace, hasher.model_seed)
        self._slots = f"{tag}:slots".encode()
        self._retired = f"{tag}:retired".encode()
        self._nodes_key = f"{tag}:nodes".encode()
        self._prefix = f"{tag}:".encode()
        self._keys = [self._slots, self._retired, self._nodes_key]
        self._own_client = client is None or close_client
        self._redis: RedisClient = client or connect(
            settings.url,
            socket_timeout_s=settings.apply_deadline_s,
            connect_timeout_s=settings.deadline_s or settings.apply_deadline_s,
            max_connections=settings.max_connections,
        )
        self._match = self._redis.register_script(_lua("match.lua"))
        self._apply = self._redis.register_script(_lua("apply.lua"))
        self._predict = self._redis.register_script(_lua("predict.lua"))
        self._forget = self._redis.register_script(_lua("forget.lua"))
        self._sweep = self._redis.register_script(_lua("sweep.lua"))
        self._maps: dict[NodeId, EngineHashMap] = {}
        self._resync: set[NodeId] = set()
        self._sweep_task: asyncio.Task[int] | None = None
        self.sweeps = 0

    def translate_stats(self, node: NodeId) -> TranslateStats:
        """How ``node``'s events translated in this process since it was last forgotten."""
        m = self._maps.get(node)
        return m.stats if m is not None else TranslateStats()

    async def _call(self, what: str, deadline: float | None, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await bounded(what, deadline, fn)
        except ResidencyUnavailable as exc:
            if "NOSLOT" in str(exc):
                self._start_sweep()
            raise

    @staticmethod
    def _blob(hashes: Sequence[BlockHash]) -> bytes:
        blob = b"".join(hashes)
        if len(blob) != BLOCK_HASH_BYTES * len(hashes):
            raise ValueError(f"block hashes must be {BLOCK_HASH_BYTES} bytes each")
        return blob

    def _apply_args(self, node: NodeId, ops: Sequence[ResidencyOp]) -> list[bytes | str | int]:
        args: list[bytes | str | int] = [self._prefix, node, BLOCK_HASH_BYTES]
        for op in ops:
            if isinstance(op, ClearOp):
                args.append(b"C")
            elif op.hashes:
                kind = b"S" if isinstance(op, StoreOp) else b"R"
                args += (kind, _TIER[op.medium], self._blob(op.hashes))
        return args

    def _ops_for(self, node: NodeId, batch: object) -> list[ResidencyOp]:
        if not isinstance(batch, EventBatch):
            raise TypeError(f"expected an EventBatch, got {type(batch).__name__}")
        emap = self._maps.get(node)
        if emap is None:
            emap = self._maps[node] = EngineHashMap(self._hasher, self._settings.group_idx)
        ops = emap.translate(batch)
        if node in self._resync:
            ops = [ClearOp(), *emap.snapshot()]
        return ops

    async def apply(self, node: NodeId, batch: object) -> None:
        await self.apply_many([(node, batch)])

    async def apply_many(self, items: Sequence[tuple[NodeId, object]]) -> None:
        """Apply batches in order in one pipelined round trip (one script call per batch)."""
        calls = [(node, self._apply_args(node, self._ops_for(node, b))) for node, b in items]

        async def run() -> None:
            if len(calls) == 1:
                await self._apply(keys=self._keys, args=calls[0][1])
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                for _, args in calls:
                    await self._apply(keys=self._keys, args=args, client=pipe)  # type: ignore[arg-type]
                await pipe.execute()

        touched = {node for node, _ in calls}
        try:
            await self._call("apply", self._settings.apply_deadline_s, run)
        except ResidencyUnavailable:
            self._resync |= touched
            raise
        self._resync -= touched

    async def match(self, hashes: Sequence[BlockHash]) -> dict[NodeId, Match]:
        if not hashes:
            return {}
        args: list[bytes | int] = [self._prefix, self._blob(hashes), BLOCK_HASH_BYTES]
        raw: list[Any] = await self._call(
            "match",
            self._settings.deadline_s,
            lambda: self._match(keys=[self._slots], args=args),
        )
        out: dict[NodeId, Match] = {}
        for i in range(0, len(raw), 5):
            node = raw[i].decode() if isinstance(raw[i], bytes) else str(raw[i])
            g, c, t, p = (int(x) for x in raw[i + 1 : i + 5])
            out[NodeId(node)] = Match(gpu=g, cpu=c, total=t, predicted=p)
        return out

    async def predict(self, node: NodeId, hashes: Sequence[BlockHash], ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if not hashes:
            return
        ttl_ms = max(1, round(ttl_s * 1000))
        args: list[bytes | str | int] = [
            self._prefix,
            node,
            BLOCK_HASH_BYTES,
            ttl_ms,
            self._blob(hashes),
        ]
        await self._call(
            "predict",
            self._settings.deadline_s,
            lambda: self._predict(keys=self._keys, args=args),
        )

    async def forget(self, node: NodeId) -> None:
        """Drop ``node``. If Redis fails, the local map is dropped anyway and the node's next
        apply clears what Redis still holds."""
        self._maps.pop(node, None)
        self._resync.add(node)
        retired = await self._call(
            "forget",
            self._settings.deadline_s,
            lambda: self._forget(keys=self._keys, args=[node]),
        )
        self._resync.discard(node)
        if int(retired) >= self.SWEEP_AFTER_RETIRED:
            self._start_sweep()

    async def nodes(self) -> list[NodeId]:
        members: set[bytes] = await self._call(
            "nodes",
            self._settings.deadline_s,
            lambda: self._redis.smembers(self._nodes_key),  # type: ignore[arg-type,return-value]
        )
        return sorted(NodeId(m.decode()) for m in members)

    async def ping(self) -> None:
        """One round trip (a health check, and the benchmark's baseline)."""
        await self._call("ping", self._settings.deadline_s, self._redis.ping)

    def _start_sweep(self) -> None:
        if self._sweep_task is None or self._sweep_task.done():
            self._sweep_task = asyncio.create_task(self.sweep(), name="residency-sweep")
            self._sweep_task.add_done_callback(_log_sweep)

    async def sweep(self, chunk: int = 500) -> int:
        """Clear retired slots' bits from every block key, then free those slots.

        Scans the model's keys in chunks (each chunk one script call under the apply
        deadline). Returns the number of slots freed.
        """
        members: set[bytes] = await self._call(
            "sweep",
            self._settings.deadline_s,
            lambda: self._redis.smembers(self._retired),  # type: ignore[arg-type,return-value]
        )
        slots = sorted(int(m) for m in members)
        if not slots:
            return 0
        mask = sum(1 << s for s in slots)
        pattern = _glob_escape(self._prefix) + b"[rp]:*"
        batch: list[bytes] = []

        async def scrub(keys: list[bytes]) -> None:
            await self._call(
                "sweep",
                self._settings.apply_deadline_s,
                lambda: self._sweep(keys=keys, args=[mask, *slots]),
            )

        try:
            async for key in self._redis.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= chunk:
                    await scrub(batch)
                    batch = []
            if batch:
                await scrub(batch)
        except (RedisError, OSError) as exc:
            raise ResidencyUnavailable(f"redis sweep failed: {exc!r}") from exc
        await self._call(
            "sweep",
            self._settings.deadline_s,
            lambda: self._redis.srem(self._retired, *slots),
        )
        self.sweeps += 1
        logger.info("residency sweep freed node slots %s", slots)
        return len(slots)

    async def close(self) -> None:
        self._maps.clear()
        task, self._sweep_task = self._sweep_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ResidencyUnavailable):
                await task
        if self._own_client:
            await self._redis.aclose()


def _glob_escape(raw: bytes) -> bytes:
    out = bytearray()
    for byte in raw:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _log_sweep(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("residency sweep failed: %s", task.exception())
