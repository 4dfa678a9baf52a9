""":class:`~pdproxy.routing.kv.state.RouterState` shared by proxy replicas through Redis.

Residency and predictions live in a :class:`~kvtier.residency.redis_index.RedisIndex`, load in
:class:`~pdproxy.routing.kv.shared_load.RedisLoad`; every call from a decision runs under one
:class:`~pdproxy.routing.kv.store_guard.StoreGuard` (the one deadline and the breaker). When the
store fails, :meth:`SharedState.observe` answers with this replica's own load and no matches
(``source="fallback"``), so the decision still answers. A heartbeat keeps this replica's load
counted and rewrites it from the local view (healing charges lost while Redis was away); the
first successful call after an outage triggers one at once. Event streams are written by one
replica each, under :class:`~pdproxy.routing.kv.stream_leases.StreamLeases`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from kvtier.errors import ResidencyError
from kvtier.keys import BlockHash
from kvtier.residency.redis_index import RedisIndex
from kvtier.residency.types import Match, NodeId
from pdproxy.fleet.backends import BreakerState
from pdproxy.routing.kv.shared_load import RedisLoad
from pdproxy.routing.kv.state import (
    LoadDelta,
    MemoryLoad,
    NodeLoad,
    Observation,
    Prediction,
    as_nodes,
)
from pdproxy.routing.kv.store_guard import StoreGuard
from pdproxy.routing.kv.stream_leases import StreamLeases

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SharedState:
    shared = True

    def __init__(
        self,
        index: RedisIndex,
        load: RedisLoad,
        guard: StoreGuard,
        *,
        heartbeat_s: float,
        leases: StreamLeases | None = None,
    ) -> None:
        self._index = index
        self._leases = leases
        self._load = load
        self._guard = guard
        self._local = MemoryLoad()
        self._heartbeat_s = heartbeat_s
        self._resync = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        guard.on_recovered = self._resync.set

    @property
    def index(self) -> RedisIndex:
        return self._index

    @property
    def local(self) -> MemoryLoad:
        return self._local

    @property
    def replica(self) -> str:
        return self._load.replica

    @property
    def breaker_state(self) -> BreakerState:
        return self._guard.state

    @property
    def leases(self) -> StreamLeases | None:
        return self._leases

    async def _store(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        return await self._guard.call(fn, what)

    async def start(self) -> None:
        await self._heartbeat_once()
        self._task = asyncio.create_task(self._heartbeat_loop(), name="kv-router heartbeat")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        with contextlib.suppress(ResidencyError):
            await self._store(self._load.leave, "leave")
        await self._index.close()

    async def observe(
        self, hashes: Sequence[BlockHash] | None, names: Sequence[str]
    ) -> Observation:
        try:
            matches, loads = await self._store(lambda: self._read(hashes, names), "observe")
        except ResidencyError:
            return Observation(None, {n: self._local.get(n) for n in names}, "fallback")
        return Observation(matches, loads, "redis")

    async def _read(
        self, hashes: Sequence[BlockHash] | None, names: Sequence[str]
    ) -> tuple[dict[NodeId, Match] | None, dict[str, NodeLoad]]:
        """Matches and loads in one round trip: the load read rides on the match's first
        chunk (on a cluster it runs beside it), so a decision waits for Redis once."""
        load = self._load
        if not hashes:
            return (None if hashes is None else {}), await load.read(names)
        riders = [load.read_call(names)] if names else []
        matches, rode = await self._index.match_with(hashes, as_nodes(names), riders)
        return matches, load.parse_read(names, rode[0]) if names else {}

    async def record(
        self, deltas: Sequence[LoadDelta], predictions: Sequence[Prediction], ttl_s: float
    ) -> bool:
        self._local.apply(deltas)
        load = self._load
        calls: list[Awaitable[None]] = [self._store(lambda: load.add(deltas), "charge load")]
        for p in predictions:
            calls.append(self._store(self._predictor(p, ttl_s), "predict"))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ResidencyError):
                raise r
        return not isinstance(results[0], BaseException)

    def _predictor(self, p: Prediction, ttl_s: float) -> Callable[[], Awaitable[None]]:
        return lambda: self._index.predict(p.node, p.hashes, ttl_s)

    async def release(self, deltas: Sequence[LoadDelta], recorded: bool) -> None:
        self._local.apply(deltas)
        if recorded:
            load = self._load
            with contextlib.suppress(ResidencyError):
                await self._store(lambda: load.add(deltas), "release load")

    async def _heartbeat_once(self) -> None:
        load = self._load
        with contextlib.suppress(ResidencyError):
            await self._store(lambda: load.heartbeat(self._local.snapshot()), "heartbeat")

    async def _heartbeat_loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that lands
            # as the event is set, and close() then waits for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._heartbeat_s):
                    await self._resync.wait()
            self._resync.clear()
            await self._heartbeat_once()
