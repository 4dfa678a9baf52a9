"""Residency index in Redis, shared by several proxies (layout: :mod:`.redis_layout`).

Each live node owns a slot (up to 65,536 per model, live and retired together). A block's
residency value is a bitmap of its holders' slots per tier, which the match walk ANDs as
integers: a thousand nodes cost a few hundred bytes per value, not a loop per node. Blocks are
fields of two hashes (residency, predictions), named by 8-byte ids packed into one argument, so
every script declares a fixed handful of keys and a match sends 8 bytes per block.

``match`` reads with plain commands, in chunks (:mod:`.redis_match`: one round trip each, the
walk in :mod:`.redis_walk`); ``match_with`` sends a caller's read-only script calls with the
first chunk. Writes run as Lua scripts (``*.lua`` beside this module) that declare every key
they touch: ``apply`` (one node's translated operations), ``predict`` (speculative entries
with a TTL; each call also scans and cleans as many prediction fields as it writes),
``forget`` (retire a node's slot), ``sweep`` (scrub retired slots' entries before the slot is
handed out again, a bounded scan step per call; in the background once
``SWEEP_AFTER_RETIRED`` slots are retired), ``free`` (hand swept slots back).

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
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

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
from kvtier.residency.redis_layout import ModelKeys, block_ids, script_source
from kvtier.residency.redis_match import RedisMatcher
from kvtier.residency.redis_settings import RedisIndexSettings
from kvtier.residency.redis_sweep import RetiredSlots
from kvtier.residency.translate import (
    ClearOp,
    ResidencyOp,
    StoreOp,
    TranslateStats,
)
from kvtier.residency.types import Match, NodeId

__all__ = ["RedisIndex", "RedisIndexSettings", "check_hashes"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_TIER = {Medium.GPU: b"G", Medium.CPU: b"C"}


def check_hashes(hashes: Sequence[BlockHash]) -> None:
    """Refuse, before sending anything, hashes that are not router block hashes."""
    wrong = set(map(len, hashes)) - {BLOCK_HASH_BYTES}  # C-level: a decision checks 512
    if wrong:
        raise ValueError(f"block hashes must be {BLOCK_HASH_BYTES} bytes each, got {min(wrong)}")


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
        self._apply = self._redis.register_script(script_source("apply.lua"))
        self._predict = self._redis.register_script(script_source("predict.lua"))
        self._forget = self._redis.register_script(script_source("forget.lua"))
        self._lease = self._redis.register_script(script_source("lease.lua"))
        self._maps = SharedEngineMaps(
            hasher,
            settings.group_idx,
            self._redis,
            self.keys,
            lambda fn: self._call("apply", settings.apply_deadline_s, fn),
            max_blocks_per_node=settings.max_blocks_per_node,
        )
        self._retired = RetiredSlots(self._redis, self.keys, settings, self._call)
        self._sweep_task: asyncio.Task[int] | None = None
        self.sweeps = 0
        self._matcher = RedisMatcher(self._redis, self.keys, settings.max_blocks_per_read)
        self.writer: str | None = None
        """This replica's name when it writes event streams under leases (apply is then
        refused unless it holds the node's lease); None: no leases (one proxy)."""
        self._script_calls = 0

    @property
    def calls(self) -> int:
        """Script calls and reads sent (a test counts chunks with it)."""
        return self._script_calls + self._matcher.calls

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
        self._script_calls += len(calls)
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
        keys = [*k.meta, k.emap(node), k.seq(node), k.lease(node), k.res]
        head: list[Any] = [node, self._settings.max_node_slots, self.writer or ""]
        calls: list[ScriptCall] = []
        args: list[Any] = []
        used = 0

        def flush() -> None:
            nonlocal args, used
            if args or not calls:  # an empty batch still makes the node known
                calls.append((self._apply, keys, head + args))
            args, used = [], 0

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
                args += [kind, _TIER[op.medium], block_ids(part)]
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

    async def lease(
        self, node: NodeId, *, take: bool, ttl_s: float, free_too: bool = True
    ) -> tuple[bool, int, int]:
        """Take (or renew) this index's writer lease on ``node``'s event stream, or drop it;
        ``free_too=False`` renews a lease held but takes no free one. Returns whether it is
        held now, the node's last applied sequence (-1: none) and the live proxy replicas."""
        if self.writer is None:
            raise ValueError("a lease needs a writer name (RedisIndex.writer)")
        k = self.keys
        mode = (b"take" if free_too else b"renew") if take else b"drop"
        args: list[bytes | str | int] = [mode, self.writer, max(1, round(ttl_s * 1000))]
        held, seq, live = await self._call(
            "lease",
            self._settings.apply_deadline_s,  # a background call, like apply
            lambda: self._lease(keys=[k.lease(node), k.seq(node), k.replicas], args=args),
        )
        return bool(held), int(seq), int(live)

    async def predict(self, node: NodeId, hashes: Sequence[BlockHash], ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if not hashes:
            return
        check_hashes(hashes)
        ttl_ms = max(1, round(ttl_s * 1000))
        limit = self._settings.max_blocks_per_call
        keys = [*self.keys.meta, self.keys.pred, self.keys.pgc]
        head: list[bytes | str | int] = [node, self._settings.max_node_slots, ttl_ms]
        calls: list[ScriptCall] = [
            (self._predict, keys, [*head, block_ids(hashes[i : i + limit])])
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

    async def match(
        self, hashes: Sequence[BlockHash], among: Collection[NodeId] | None = None
    ) -> dict[NodeId, Match]:
        matches, _ = await self.match_with(hashes, among)
        return matches

    async def match_with(
        self,
        hashes: Sequence[BlockHash],
        among: Collection[NodeId] | None = None,
        riders: Sequence[ScriptCall] = (),
    ) -> tuple[dict[NodeId, Match], list[Any]]:
        """:meth:`match`, plus the replies of ``riders``: read-only script calls (on this
        index's client) sent in the same round trip as the first chunk."""
        check_hashes(hashes)
        if not hashes:
            if not riders:
                return {}, []
            rode = await self._call(
                "match", self._settings.deadline_s, lambda: self._scripts(riders)
            )
            return {}, rode
        return await self._call(
            "match",
            self._settings.deadline_s,
            lambda: self._matcher.match(hashes, among, riders),
        )

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
        """Scrub retired slots' entries from every block, then free those slots
        (:mod:`.redis_sweep`: about ``chunk`` fields per script call, each under the apply
        deadline). Returns the number of slots freed."""
        slots = await self._retired.sweep(chunk)
        if slots:
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


def _log_sweep(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("residency sweep failed: %s", task.exception())
