"""Residency index in Redis, shared by several proxies (layout: :mod:`.redis_layout`).

Each live node owns a slot (up to 65,536 per model, live and retired together). A block's
residency value lists its holders' slots, so reading it costs its number of holders, never the
number of nodes: ``match`` over a thousand idle nodes costs what it costs over one.

``match`` reads residency and prediction values in chunks (a short first one, then up to
``max_blocks_per_read`` blocks), one read-only script call each (``read``: the values, the Redis
clock, and the names of the slots the values mention; a slot that names no node is retired and
ignored), and walks them here (:mod:`.redis_walk`); it stops reading at the first block that no
node still matching holds or has predicted. Writes run as Lua scripts
(``*.lua`` beside this module) that declare every key they touch: ``apply`` (one node's translated
operations), ``predict`` (speculative entries with a TTL), ``forget`` (retire a node's slot),
``sweep`` (scrub retired slots' entries before the slot is handed out again; in the background
once ``SWEEP_AFTER_RETIRED`` slots are retired), ``free`` (hand swept slots back).

Cost per call is bounded whatever the prompt: every write names at most
``max_blocks_per_call`` blocks and every read ``max_blocks_per_read``; a longer prompt or batch
is split into several calls, so a Redis server serves other clients between them (a script
that runs stops every other client, and the client's deadline cannot interrupt it). Hashes are
checked before anything is sent.

Every call runs under a deadline (``deadline_s``, or none when the caller bounds each call, as
the router's store guard does; ``apply_deadline_s`` for writes from event feeds), with no
retries: a dead, paused or slow Redis raises :class:`kvtier.errors.ResidencyUnavailable` in
milliseconds. A failed ``apply`` marks the node for a resync: its next successful one clears it
in Redis and rewrites everything the node's engine-hash map knows.
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
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from kvtier.errors import ResidencyUnavailable
from kvtier.events.types import EventBatch, Medium
from kvtier.keys import BLOCK_HASH_BYTES, BlockHash, BlockHasher
from kvtier.residency.redis_client import RedisClient, bounded, connect
from kvtier.residency.redis_layout import MAX_SLOTS, ModelKeys
from kvtier.residency.redis_walk import Walk
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
FIRST_MATCH_CHUNK = 64
"""Blocks read by a match's first MGET: most prompts that match nothing stop there."""


class RedisIndexSettings(BaseSettings):
    """Connection and deadlines of :class:`RedisIndex` (env prefix ``KVTIER_RESIDENCY_``)."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_RESIDENCY_")

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL; redis+cluster://host:port for a Redis Cluster",
    )
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
    max_node_slots: int = Field(
        default=MAX_SLOTS,
        ge=1,
        le=MAX_SLOTS,
        description="most node slots per model, live and retired together",
    )
    max_blocks_per_call: int = Field(
        default=256,
        ge=1,
        le=8192,
        description="most blocks one write script call names (apply, predict: bounds the time "
        "one call holds Redis; longer prompts and batches take several calls)",
    )
    max_blocks_per_read: int = Field(
        default=512,
        ge=1,
        le=8192,
        description="most blocks one match read names (reads cost less per block than writes)",
    )


def _lua(name: str) -> str:
    return files("kvtier.residency").joinpath(name).read_text(encoding="utf-8")


def check_hashes(hashes: Sequence[BlockHash]) -> None:
    """Refuse, before sending anything, hashes that are not router block hashes."""
    for h in hashes:
        if len(h) != BLOCK_HASH_BYTES:
            raise ValueError(f"block hashes must be {BLOCK_HASH_BYTES} bytes each, got {len(h)}")


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
        self.keys = ModelKeys.of(settings.namespace, hasher.model_seed)
        self._own_client = client is None or close_client
        self._redis: RedisClient = client or connect(
            settings.url,
            socket_timeout_s=settings.apply_deadline_s,
            connect_timeout_s=settings.deadline_s or settings.apply_deadline_s,
            max_connections=settings.max_connections,
        )
        self._cluster = isinstance(self._redis, RedisCluster)
        self._apply = self._redis.register_script(_lua("apply.lua"))
        self._predict = self._redis.register_script(_lua("predict.lua"))
        self._forget = self._redis.register_script(_lua("forget.lua"))
        self._sweep = self._redis.register_script(_lua("sweep.lua"))
        self._free = self._redis.register_script(_lua("free.lua"))
        self._read = self._redis.register_script(_lua("read.lua"))
        self._maps: dict[NodeId, EngineHashMap] = {}
        self._resync: set[NodeId] = set()
        self._sweep_task: asyncio.Task[int] | None = None
        self.sweeps = 0
        self.calls = 0
        """Script calls and MGETs sent (a test counts chunks with it)."""

    @property
    def max_blocks_per_call(self) -> int:
        return self._settings.max_blocks_per_call

    @property
    def max_blocks_per_read(self) -> int:
        return self._settings.max_blocks_per_read

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

    async def _scripts(self, calls: Sequence[tuple[Any, list[bytes], list[Any]]]) -> list[Any]:
        """Run script calls in order: one pipelined round trip on a single node; one call
        after another on a cluster (its client pipelines no scripts)."""
        self.calls += len(calls)
        if len(calls) == 1:
            script, keys, args = calls[0]
            return [await script(keys=keys, args=args)]
        if self._cluster:
            return [await script(keys=keys, args=args) for script, keys, args in calls]
        async with self._redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return list(await pipe.execute())

    # -- writes ----------------------------------------------------------------------------

    def _apply_calls(
        self, node: NodeId, ops: Sequence[ResidencyOp]
    ) -> list[tuple[Any, list[bytes], list[Any]]]:
        """``ops`` as apply.lua calls of at most ``max_blocks_per_call`` blocks each."""
        limit = self._settings.max_blocks_per_call
        head: list[Any] = [node, self._settings.max_node_slots]
        calls: list[tuple[Any, list[bytes], list[Any]]] = []
        keys: list[bytes] = []
        args: list[Any] = []

        def flush() -> None:
            nonlocal keys, args
            if args or not calls:  # an empty batch still makes the node known
                calls.append((self._apply, self.keys.meta + keys, head + args))
            keys, args = [], []

        r = self.keys.r
        for op in ops:
            if isinstance(op, ClearOp):
                args.append(b"C")
                continue
            check_hashes(op.hashes)
            kind = b"S" if isinstance(op, StoreOp) else b"R"
            hashes = op.hashes
            start = 0
            while start < len(hashes):
                room = limit - len(keys)
                if room == 0:
                    flush()
                    continue
                part = hashes[start : start + room]
                keys += [r + h for h in part]
                args += [kind, _TIER[op.medium], len(part)]
                start += len(part)
        flush()
        return calls

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
        """Apply batches in order (pipelined on a single node; bounded script calls)."""
        calls: list[tuple[Any, list[bytes], list[Any]]] = []
        for node, b in items:
            calls += self._apply_calls(node, self._ops_for(node, b))
        touched = {node for node, _ in items}
        if calls:
            try:
                await self._call(
                    "apply", self._settings.apply_deadline_s, lambda: self._scripts(calls)
                )
            except ResidencyUnavailable:
                self._resync |= touched
                raise
        self._resync -= touched

    async def predict(self, node: NodeId, hashes: Sequence[BlockHash], ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if not hashes:
            return
        check_hashes(hashes)
        ttl_ms = max(1, round(ttl_s * 1000))
        limit = self._settings.max_blocks_per_call
        head = [*self.keys.meta, self.keys.plive]
        p = self.keys.p
        calls = [
            (
                self._predict,
                head + [p + h for h in hashes[i : i + limit]],
                [node, self._settings.max_node_slots, ttl_ms],
            )
            for i in range(0, len(hashes), limit)
        ]
        await self._call("predict", self._settings.deadline_s, lambda: self._scripts(calls))

    async def forget(self, node: NodeId) -> None:
        """Drop ``node``. If Redis fails, the local map is dropped anyway and the node's next
        apply clears what Redis still holds."""
        self._maps.pop(node, None)
        self._resync.add(node)
        k = self.keys
        retired = await self._call(
            "forget",
            self._settings.deadline_s,
            lambda: self._forget(keys=[k.slots, k.names, k.nodes, k.retired], args=[node]),
        )
        self._resync.discard(node)
        if int(retired) >= self.SWEEP_AFTER_RETIRED:
            self._start_sweep()

    # -- reads -----------------------------------------------------------------------------

    async def match(self, hashes: Sequence[BlockHash]) -> dict[NodeId, Match]:
        if not hashes:
            return {}
        check_hashes(hashes)
        return await self._call("match", self._settings.deadline_s, lambda: self._match(hashes))

    async def _match(self, hashes: Sequence[BlockHash]) -> dict[NodeId, Match]:
        k = self.keys
        limit = self._settings.max_blocks_per_read
        walk: Walk | None = None
        names: dict[int, str] = {}
        start = 0
        while start < len(hashes) and (walk is None or walk.alive):
            part = hashes[start : start + (FIRST_MATCH_CHUNK if start == 0 else limit)]
            keys = [k.names, k.plive, *(k.r + h for h in part), *(k.p + h for h in part)]
            self.calls += 1
            now_ms, rv, pv, named = await self._read(keys=keys, args=[len(part)])
            if walk is None:
                walk = Walk(int(now_ms))
            for i in range(0, len(named), 2):
                names[int(named[i])] = named[i + 1].decode()
            walk.feed(rv, pv)
            start += len(part)
        out: dict[NodeId, Match] = {}
        for slot, (g, c, t, p) in (walk.result() if walk is not None else {}).items():
            name = names.get(slot)
            if name is not None:  # None: a retired slot awaiting its sweep
                out[NodeId(name)] = Match(gpu=g, cpu=c, total=t, predicted=p)
        return out

    async def nodes(self) -> list[NodeId]:
        members: set[bytes] = await self._call(
            "nodes",
            self._settings.deadline_s,
            lambda: self._redis.smembers(self.keys.nodes),  # type: ignore[arg-type,return-value]
        )
        return sorted(NodeId(m.decode()) for m in members)

    async def ping(self) -> None:
        """One round trip (a health check, and the benchmark's baseline)."""
        await self._call("ping", self._settings.deadline_s, self._redis.ping)

    # -- retired slots ---------------------------------------------------------------------

    def _start_sweep(self) -> None:
        if self._sweep_task is None or self._sweep_task.done():
            self._sweep_task = asyncio.create_task(self.sweep(), name="residency-sweep")
            self._sweep_task.add_done_callback(_log_sweep)

    async def sweep(self, chunk: int = 500) -> int:
        """Scrub retired slots' entries from every block key, then free those slots.

        Scans the model's keys in chunks (each chunk one script call under the apply
        deadline). Returns the number of slots freed.
        """
        k = self.keys
        members: set[bytes] = await self._call(
            "sweep",
            self._settings.deadline_s,
            lambda: self._redis.smembers(k.retired),  # type: ignore[arg-type,return-value]
        )
        slots = sorted(int(m) for m in members)
        if not slots:
            return 0
        pattern = _glob_escape(k.tag.encode()) + b":[rp]:*"
        batch: list[bytes] = []

        async def scrub(keys: list[bytes]) -> None:
            await self._call(
                "sweep",
                self._settings.apply_deadline_s,
                lambda: self._sweep(keys=keys, args=slots),
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
            lambda: self._free(keys=[k.retired, k.free], args=slots),
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
