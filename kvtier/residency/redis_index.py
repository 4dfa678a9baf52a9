"""Residency index in Redis, shared by several proxies (layout: :mod:`.redis_layout`).

Each live node owns a slot (up to 65,536 per model, live and retired together). A block's
residency value is a bitmap of its holders' slots per tier, which the match walk ANDs as
integers: a thousand nodes cost a few hundred bytes per value, not a loop per node.

``match`` reads residency and prediction values in chunks (a short first one, then up to
``max_blocks_per_read`` blocks), one read-only script call each (``read``: the values, the Redis
clock and the names epoch), and walks them here (:mod:`.redis_walk`, integer ANDs); it stops
reading at the first block that no node still matching holds or has predicted. Slot names are
cached until the epoch moves (a slot was retired or handed back); a slot that names no node is
retired and ignored. Writes run as Lua scripts
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

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from kvtier.errors import ResidencyUnavailable
from kvtier.events.types import Medium
from kvtier.keys import BLOCK_HASH_BYTES, BlockHash, BlockHasher
from kvtier.residency.redis_client import (
    RedisClient,
    ScriptCall,
    bounded,
    connect,
    run_scripts,
)
from kvtier.residency.redis_emap import MapWrite, SharedEngineMaps
from kvtier.residency.redis_layout import (
    ModelKeys,
)
from kvtier.residency.redis_settings import RedisIndexSettings
from kvtier.residency.redis_walk import Walk
from kvtier.residency.translate import (
    ClearOp,
    ResidencyOp,
    StoreOp,
    TranslateStats,
)
from kvtier.residency.types import Match, NodeId

__all__ = ["FIRST_MATCH_CHUNK", "RedisIndex", "RedisIndexSettings", "check_hashes"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_TIER = {Medium.GPU: b"G", Medium.CPU: b"C"}
FIRST_MATCH_CHUNK = 64
"""Blocks read by a match's first MGET: most prompts that match nothing stop there."""


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
        self._lease = self._redis.register_script(_lua("lease.lua"))
        self._maps = SharedEngineMaps(
            hasher,
            settings.group_idx,
            self._redis,
            self.keys,
            lambda fn: self._call("apply", settings.apply_deadline_s, fn),
        )
        self._sweep_task: asyncio.Task[int] | None = None
        self.sweeps = 0
        self._names_cache: dict[int, str | None] = {}
        self._names_epoch = -1
        self.writer: str | None = None
        """This replica's name when it writes event streams under leases (apply is then
        refused unless it holds the node's lease); None: no leases (one proxy)."""
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
        return self._maps.stats(node)

    async def _call(self, what: str, deadline: float | None, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await bounded(what, deadline, fn)
        except ResidencyUnavailable as exc:
            if "NOSLOT" in str(exc):
                self._start_sweep()
            raise

    async def _scripts(self, calls: Sequence[ScriptCall]) -> list[Any]:
        """Run script calls in order: one packed round trip on a single node; one call after
        another on a cluster (its client pipelines no scripts)."""
        self.calls += len(calls)
        if self._cluster:
            return [await script(keys=keys, args=args) for script, keys, args in calls]
        assert isinstance(self._redis, Redis)
        return await run_scripts(self._redis, calls)

    # -- writes ----------------------------------------------------------------------------

    def _apply_calls(
        self, node: NodeId, ops: Sequence[ResidencyOp], tail: Sequence[list[Any]]
    ) -> list[ScriptCall]:
        """``ops`` then ``tail`` (engine-hash map and sequence operations) as apply.lua calls
        of at most ``max_blocks_per_call`` blocks or map entries each."""
        limit = self._settings.max_blocks_per_call
        k = self.keys
        fixed = [*k.meta, k.emap(node), k.seq(node), k.lease(node)]  # KEYS[1..10]
        head: list[Any] = [node, self._settings.max_node_slots, self.writer or ""]
        calls: list[ScriptCall] = []
        keys: list[bytes] = []
        args: list[Any] = []
        used = 0

        def flush() -> None:
            nonlocal keys, args, used
            if args or not calls:  # an empty batch still makes the node known
                calls.append((self._apply, fixed + keys, head + args))
            keys, args, used = [], [], 0

        for op in ops:
            if isinstance(op, ClearOp):
                args.append(b"C")
                continue
            check_hashes(op.hashes)
            kind = b"S" if isinstance(op, StoreOp) else b"R"
            hashes = op.hashes
            start = 0
            while start < len(hashes):
                if used == limit:
                    flush()
                part = hashes[start : start + limit - used]
                keys += [k.r + h for h in part]
                args += [kind, _TIER[op.medium], len(part)]
                start += len(part)
                used += len(part)
        for extra in tail:
            if used == limit:
                flush()
            args += extra
            used += 1
        flush()
        return calls

    async def apply(self, node: NodeId, batch: object, *, seq: int | None = None) -> None:
        """Apply one batch; ``seq`` (its sequence number on the node's stream) is recorded
        so a replica taking the stream over replays from the next one."""
        await self._apply_items([(node, batch, seq)])

    async def apply_many(self, items: Sequence[tuple[NodeId, object]]) -> None:
        """Apply batches in order (pipelined on a single node; bounded script calls)."""
        await self._apply_items([(node, b, None) for node, b in items])

    async def _apply_items(self, items: Sequence[tuple[NodeId, object, int | None]]) -> None:
        calls: list[ScriptCall] = []
        tails: list[tuple[NodeId, list[MapWrite]]] = []
        touched = {node for node, _, _ in items}
        try:
            for node, b, seq in items:
                ops, tail = await self._maps.translate(node, b)
                tails.append((node, tail))
                if seq is not None:
                    tail.append([b"Q", seq])
                calls += self._apply_calls(node, ops, tail)
            await self._call("apply", self._settings.apply_deadline_s, lambda: self._scripts(calls))
        except ResidencyUnavailable:
            self._maps.failed(touched, tails)
            raise
        self._maps.written(touched)

    async def lease(self, node: NodeId, *, take: bool, ttl_s: float) -> tuple[bool, int]:
        """Take (or renew) this index's writer lease on ``node``'s event stream, or drop it.
        Returns whether it is held now and the node's last applied sequence (-1: none)."""
        if self.writer is None:
            raise ValueError("a lease needs a writer name (RedisIndex.writer)")
        k = self.keys
        args = [b"take" if take else b"drop", self.writer, max(1, round(ttl_s * 1000))]
        held, seq = await self._call(
            "lease",
            self._settings.apply_deadline_s,  # a background call, like apply
            lambda: self._lease(keys=[k.lease(node), k.seq(node)], args=args),
        )
        return bool(held), int(seq)

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
        calls: list[ScriptCall] = [
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
        self._maps.forgetting(node)
        k = self.keys
        retired = await self._call(
            "forget",
            self._settings.deadline_s,
            lambda: self._forget(
                keys=[k.slots, k.names, k.nodes, k.retired, k.emap(node), k.seq(node), k.epoch],
                args=[node],
            ),
        )
        self._maps.forgotten(node)
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
        epoch = 0
        start = 0
        while start < len(hashes) and (walk is None or walk.alive):
            part = hashes[start : start + (FIRST_MATCH_CHUNK if start == 0 else limit)]
            keys = [k.epoch, k.plive, *(k.r + h for h in part), *(k.p + h for h in part)]
            now_ms, epoch, rv, pv = (await self._scripts([(self._read, keys, [len(part)])]))[0]
            if walk is None:
                walk = Walk(int(now_ms))
            walk.feed(rv, pv)
            start += len(part)
        lengths = walk.result() if walk is not None else {}
        names = await self._names(int(epoch), list(lengths))
        out: dict[NodeId, Match] = {}
        for slot, (g, c, t, p) in lengths.items():
            name = names.get(slot)
            if name is not None:  # None: a retired slot awaiting its sweep
                out[NodeId(name)] = Match(gpu=g, cpu=c, total=t, predicted=p)
        return out

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
            got: list[Any] = await self._redis.hmget(self.keys.names, missing)
            for slot, name in zip(missing, got, strict=True):
                cache[slot] = name.decode() if name is not None else None
        return cache

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
            lambda: self._free(keys=[k.retired, k.free, k.epoch], args=slots),
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
