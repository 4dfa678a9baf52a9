"""A consumer's half of KV transfer: fetch the blocks of a prompt's longest hit that the device
lacks (from a producer's supply, or from a holder by symmetric pull), then install them.

The blocks arrive in host pages (verified by :class:`~kvtier.p2p.client.P2PClient`), are copied
into fresh device pages, registered in the prefix cache and pinned for the request; admission
then finds them as prefix hits, and anything missing is recomputed. Concurrent requests with a
shared prefix fetch it once: a request waits (bounded) for another's fetch of the same keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

from kvtier.errors import KvtierError
from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.offload.pool import HostPagePool
from kvtier.offload.tiering import TieringManager
from kvtier.offload.types import LookupResult, ReqContext, RequestId
from kvtier.offload.window import AttentionKind, ChunkLayout, needed_chunks
from kvtier.p2p.client import FetchResult
from kvtier.pages import CopyDirection
from kvtier.worker.holder import PageCopy
from kvtier.worker.kv_cache import KVCache
from kvtier.worker.kv_events import KVEventRelay
from kvtier.worker.request import EngineRequest

logger = logging.getLogger(__name__)

Fetch = Callable[[list[OffloadKey], float], Awaitable[FetchResult]]
"""``fetch(wanted keys, deadline)``: one fetch or pull of ``wanted`` into the host pool."""


class RemotePrefix:
    """Brings a prompt's missing prefix blocks into the device's prefix cache."""

    def __init__(
        self,
        *,
        kv: KVCache,
        pool: HostPagePool,
        manager: TieringManager,
        layout: ChunkLayout,
        copy_pages: PageCopy,
        events: KVEventRelay,
        fetch_timeout_s: float,
    ) -> None:
        self._kv = kv
        self._pool = pool
        self._manager = manager
        self._layout = layout
        self._copy_pages = copy_pages
        self._events = events
        self._fetch_timeout_s = fetch_timeout_s
        self._inflight: dict[OffloadKey, asyncio.Future[None]] = {}

    async def bring(
        self,
        req: EngineRequest,
        fetch: Fetch,
        *,
        rounds: int = 1,
    ) -> list[FetchResult] | None:
        """Fetch (``fetch(wanted keys, deadline)``) the blocks of the prompt's longest hit that
        the device lacks, then install what arrived; None when the device holds them all.

        ``rounds`` 2 (a holder, which may hold a shorter prefix than the request): when the
        first answer ends early, the full-attention blocks that arrived bound the hit, and the
        window blocks that shorter hit reads (not asked for: they lie outside the full hit's
        window) are asked for once more.
        """
        bs = self._kv.block_size
        hashes = req.hashes.hashes[: len(req.prompt_ids) // bs]
        cap = self._kv.max_hit_blocks(len(req.prompt_ids), bs)
        if self._kv.hit_blocks(hashes, cap) >= cap:
            return None
        self._events.remember(hashes, req.prompt_ids)
        deadline = time.monotonic() + self._fetch_timeout_s

        def available(group: int, block: int) -> bool:
            if self._on_device(hashes, group, block):
                return True
            return self._pool.lookup(offload_key(hashes[block], group)) is LookupResult.HIT

        def bound(group: int, block: int) -> bool:
            windowed = self._layout.groups[group].kind is AttentionKind.SLIDING_WINDOW
            return windowed or available(group, block)

        results: list[FetchResult] = []
        target = cap
        wanted = self._keys_for(hashes, cap, lambda g, b: self._on_device(hashes, g, b))
        for _ in range(rounds):
            results.append(await self._fetch_once(wanted, deadline, fetch))
            hit = self._kv.hit_blocks(hashes, target, has=available)
            target = self._kv.hit_blocks(hashes, target, has=bound)
            wanted = self._keys_for(hashes, target, available)
            if hit >= target or not wanted:
                break
        await self._install(req, hashes, self._kv.hit_blocks(hashes, cap, has=available))
        return results

    async def _fetch_once(
        self,
        wanted: list[OffloadKey],
        deadline: float,
        fetch: Fetch,
    ) -> FetchResult:
        """``fetch(wanted, deadline)``, after other requests' fetches of the same keys."""
        await self._await_inflight(wanted, deadline)
        mine = [k for k in wanted if k not in self._inflight]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in mine:
            self._inflight[key] = done
        try:
            return await fetch(wanted, deadline)
        finally:
            for key in mine:
                if self._inflight.get(key) is done:
                    del self._inflight[key]
            done.set_result(None)

    async def _await_inflight(self, keys: Sequence[OffloadKey], deadline: float) -> None:
        """Wait (bounded by ``deadline``) for other requests' fetches of any of ``keys``: a
        shared prefix is fetched once, and a concurrent fetch never races it for host pages."""
        pending = {id(f): f for k in keys if (f := self._inflight.get(k)) is not None}
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining > 0:
            await asyncio.wait(list(pending.values()), timeout=remaining)

    def _on_device(self, hashes: Sequence[BlockHash], group: int, block: int) -> bool:
        return self._kv.pools[group].lookup(hashes[block]) is not None

    def _keys_for(
        self, hashes: Sequence[BlockHash], hit: int, present: Callable[[int, int], bool]
    ) -> list[OffloadKey]:
        """Keys of the blocks a hit of ``hit`` blocks reads that are not ``present``, in chunk
        order (block by block, groups within a block), so a gap cuts only what follows it."""
        wanted = [
            (b, pool.spec.index)
            for pool in self._kv.pools
            for b in self._needed(pool.spec.index, hit)
            if not present(pool.spec.index, b)
        ]
        return [offload_key(hashes[b], g) for b, g in sorted(wanted)]

    def _needed(self, group: int, hit: int) -> range:
        return needed_chunks(hit, self._layout.groups[group], self._layout)

    async def _install(self, req: EngineRequest, hashes: Sequence[BlockHash], hit: int) -> None:
        """Copy host pages of the hit's missing blocks into fresh device pages; pin them."""
        ctx = ReqContext(RequestId(f"consumer:{req.request_id}:{uuid.uuid4().hex[:8]}"), None)
        self._manager.on_new_request(ctx)
        try:
            for pool in self._kv.pools:
                g = pool.spec.index
                blocks = [b for b in self._needed(g, hit) if not self._on_device(hashes, g, b)]
                keys = [offload_key(hashes[b], g) for b in blocks]
                if not keys:
                    continue
                try:
                    spec = self._manager.prepare_load(keys, ctx)
                except KvtierError as exc:
                    logger.warning(
                        "request %s: host pages vanished before install: %s", req.request_id, exc
                    )
                    return
                try:
                    await self._install_group(req, g, hashes, blocks, spec.page_indices)
                finally:
                    self._manager.complete_load(keys, ctx)
        finally:
            self._manager.on_request_finished(ctx)

    async def _install_group(
        self,
        req: EngineRequest,
        group: int,
        hashes: Sequence[BlockHash],
        blocks: Sequence[int],
        host_pages: Sequence[int],
    ) -> None:
        device_pages: list[int] = []
        for _ in blocks:
            page = self._kv.allocate_spare(group)
            if page is None:
                break
            device_pages.append(page)
            req.pinned.append((group, page))
        n = len(device_pages)
        if n < len(blocks):
            logger.warning(
                "request %s: no device page for %d fetched blocks of group %d",
                req.request_id,
                len(blocks) - n,
                group,
            )
        try:
            await self._copy_pages(
                group, CopyDirection.HOST_TO_DEVICE, device_pages, host_pages[:n]
            )
        except KvtierError:
            logger.exception("request %s: host→GPU copy failed", req.request_id)
            return
        bs = self._kv.block_size
        for block, page in zip(blocks, device_pages, strict=False):
            parent = hashes[block - 1] if block > 0 else None
            tokens = req.prompt_ids[block * bs : (block + 1) * bs]
            self._kv.register(group, page, hashes[block], parent, tokens)
