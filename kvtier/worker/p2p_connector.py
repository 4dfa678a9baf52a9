"""The kvtier connector: producer legs supply over P2P through the tiering manager, consumer legs
fetch the missing range from the producer, install verified pages and recompute from any gap.

Producer leg (after its prefill; the engine still holds the GPU pages):
``on_new_request`` (the P2P tier declares REQUEST_LEVEL for the leg's ``kv_request_id``) →
``plan_store`` (every full chunk of both groups; freed or out-of-window chunks as cascade-only) →
``prepare_store`` (only chunks the host tier lacks are copied; the rest cascade, in-flight ones
are parked) → GPU→host copy → ``complete_store`` → ``on_request_finished``. The P2P tier now
holds the supply until the consumer says ``done``, anyone releases it, or its lease expires.

Consumer leg (before admission): local GPU prefix hit → the keys the hit up to the prompt's
load end still needs → :meth:`P2PClient.fetch` (skips keys the host tier holds; talks only to
the producer node the leg names, when it names one; verifies key and MAC under the session key
before installing into host pages) → host→GPU copy into fresh device pages, which are
registered in the prefix cache and pinned for the request. Admission then finds them as prefix
hits; anything missing is simply recomputed (counted).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.errors import KvtierError
from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.offload.pool import HostPagePool
from kvtier.offload.scan import RequestChunks, plan_store
from kvtier.offload.tiering import TieringManager
from kvtier.offload.types import LookupResult, ReqContext, RequestId
from kvtier.offload.window import AttentionKind, ChunkLayout, GroupSpec, needed_chunks
from kvtier.p2p.client import P2PClient
from kvtier.p2p.handshake import LocalIdentity
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.pool_pages import PoolSink
from kvtier.p2p.server import P2PServer
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.supply import SupplyRegistry
from kvtier.p2p.tier import P2PTier
from kvtier.pages import CopyDirection, DevicePages, HostPages, PageCopier
from kvtier.worker.backends.base import NO_PAGE
from kvtier.worker.connector import KVConnector, ProducerOutcome
from kvtier.worker.kv_cache import KVCache
from kvtier.worker.kv_params import ConsumerLeg, ProducerLeg, producer_answer
from kvtier.worker.request import EngineRequest, PromptKV, PromptKVHook
from kvtier.worker.worker import Worker

logger = logging.getLogger(__name__)

_COPY_TIMEOUT_S = 30.0


def chunk_layout(kv: KVCache) -> ChunkLayout:
    """The engine's groups as the tiering manager sees them (one block per chunk)."""
    groups = tuple(
        GroupSpec(p.spec.index)
        if p.spec.sliding_window is None
        else GroupSpec(p.spec.index, AttentionKind.SLIDING_WINDOW, p.spec.sliding_window)
        for p in kv.pools
    )
    return ChunkLayout(kv.block_size, 1, groups)


class P2PConnector(KVConnector):
    """Tiering manager (host pool + P2P tier), P2P server (producer) and client (consumer)."""

    def __init__(self, worker: Worker, p2p: P2PSettings) -> None:
        settings = worker.settings
        self.worker = worker
        self.kv = worker.engine.kv
        self.stats = worker.stats
        self.layout = chunk_layout(self.kv)
        page_bytes = tuple(p.spec.page_nbytes for p in self.kv.pools)
        self.host = HostPages(settings.host_pages, max(page_bytes))
        self.pool = HostPagePool(self.host)
        self.fingerprint = LayoutFingerprint(
            settings.hash_seed, settings.block_size, str(self.kv.pools[0].spec.dtype), page_bytes
        )
        self.registry = SupplyRegistry(p2p.lease_s, released_memory=p2p.released_memory)
        self.tier = P2PTier(self.pool, self.registry, self.fingerprint)
        self.manager = TieringManager(self.pool, [self.tier])
        node_id = settings.engine_id or f"kvtier-{uuid.uuid4().hex[:12]}"
        self.engine_id = node_id
        self.identity = LocalIdentity.from_settings(node_id, self.fingerprint, p2p)
        self.p2p = p2p
        self.advertise_host = settings.advertise_host or settings.host
        if self.advertise_host in ("0.0.0.0", "::", ""):
            logger.warning(
                "listening on all interfaces; set --advertise-host so consumers can "
                "reach this producer (advertising 127.0.0.1 meanwhile)"
            )
            self.advertise_host = "127.0.0.1"
        self.server = (
            P2PServer(p2p, self.identity, self.registry)
            if settings.role in ("producer", "both")
            else None
        )
        self.client = (
            P2PClient(p2p, self.identity, PoolSink(self.pool))
            if settings.role in ("consumer", "both")
            else None
        )
        self.copiers = [
            PageCopier(DevicePages(p.storage), self.host, blocks_per_page=1) for p in self.kv.pools
        ]
        self._copy_executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-page-copy")
        self._inflight: dict[OffloadKey, asyncio.Future[None]] = {}
        self._releases: set[asyncio.Task[None]] = set()
        worker.events.add_source(self.manager.take_events)

    @property
    def p2p_port(self) -> int:
        return self.server.port if self.server is not None else 0

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()
            logger.info("p2p server %s listening on port %d", self.engine_id, self.server.port)

    async def close(self) -> None:
        for task in list(self._releases):
            task.cancel()
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        try:
            if self.server is not None:
                await self.server.stop()
            if self.client is not None:
                await self.client.close()
        finally:
            self.registry.close()
            self.manager.close()
            self._copy_executor.shutdown(wait=True)

    def release(self, kv_request_id: str) -> bool:
        return self.tier.release(kv_request_id, "released over HTTP")

    # -- copies --------------------------------------------------------------------------------
    async def _copy(
        self, group: int, direction: CopyDirection, blocks: Sequence[int], pages: Sequence[int]
    ) -> None:
        if not blocks:
            return
        copier = self.copiers[group]

        def run() -> None:
            copier.wait(copier.submit(direction, blocks, pages), _COPY_TIMEOUT_S)

        await asyncio.get_running_loop().run_in_executor(self._copy_executor, run)

    # -- producer ------------------------------------------------------------------------------
    def producer_hook(
        self, leg: ProducerLeg, request_id: str, outcome: ProducerOutcome
    ) -> PromptKVHook | None:
        if self.server is None:
            self.stats.kv_params_fallbacks += 1
            logger.warning(
                "request %s: producer leg on a %s-only worker runs plainly",
                request_id,
                self.worker.settings.role,
            )
            return None

        async def supply(kv: PromptKV) -> None:
            await self._supply(leg, kv, outcome)

        return supply

    async def _supply(self, leg: ProducerLeg, kv: PromptKV, outcome: ProducerOutcome) -> None:
        # The tier speaks the P2P dialect; a NIXL-shaped leg is the same supply under its id.
        params = {"remote_decoder": {"kv_request_id": leg.kv_request_id}}
        ctx = ReqContext(RequestId(f"producer:{leg.kv_request_id}:{uuid.uuid4().hex[:8]}"), params)
        self.manager.on_new_request(ctx)
        try:
            freed = tuple(
                frozenset(b for b, page in enumerate(table) if page == NO_PAGE)
                for table in kv.page_tables
            )
            chunks = RequestChunks.from_block_hashes(
                self.layout, kv.block_hashes, kv.num_prompt_tokens, freed=freed
            )
            plan = plan_store(chunks, self.layout, request_level=ctx.is_request_level)
            out = self.manager.prepare_store(plan.keys, ctx, cascade_only=plan.cascade_only)
            ok = await self._store_copies(kv, out.keys_to_store, out.store_spec.page_indices)
            self.manager.complete_store(out.keys_to_store, ctx, ok)
            self.stats.p2p_blocks_supplied += len(plan.keys) + len(plan.cascade_only)
        finally:
            self.manager.on_request_finished(ctx)
        outcome.answer = producer_answer(
            leg,
            host=self.advertise_host,
            port=self.p2p_port,
            num_blocks=len(kv.block_hashes),
            block_ids=[p for p in kv.page_tables[0]],
            engine_id=self.engine_id,
        )

    async def _store_copies(
        self, kv: PromptKV, keys: Sequence[OffloadKey], host_pages: Sequence[int]
    ) -> bool:
        index = {
            offload_key(h, g): (g, b)
            for b, h in enumerate(kv.block_hashes)
            for g in range(len(kv.page_tables))
        }
        per_group: dict[int, tuple[list[int], list[int]]] = {}
        for key, host_page in zip(keys, host_pages, strict=True):
            group, block = index[key]
            blocks, pages = per_group.setdefault(group, ([], []))
            blocks.append(kv.page_tables[group][block])
            pages.append(host_page)
        try:
            for group, (blocks, pages) in per_group.items():
                await self._copy(group, CopyDirection.DEVICE_TO_HOST, blocks, pages)
        except KvtierError:
            logger.exception("request %s: GPU→host copy failed", kv.request_id)
            return False
        return True

    # -- consumer ------------------------------------------------------------------------------
    async def load_remote(self, req: EngineRequest, leg: ConsumerLeg) -> None:
        bs = self.kv.block_size
        hashes = req.hashes.hashes[: len(req.prompt_ids) // bs]
        cap = self.kv.max_hit_blocks(len(req.prompt_ids), bs)
        req.expected_remote_blocks = cap
        if self.client is None:
            self.stats.kv_params_fallbacks += 1
            logger.warning(
                "request %s: consumer leg on a producer-only worker runs locally", req.request_id
            )
            return
        local = self.kv.hit_blocks(hashes, cap)
        if local >= cap:
            await self._finish_remote(leg)
            return
        wanted = self._keys_for(hashes, cap, lambda g, b: self._on_device(hashes, g, b))
        self.worker.events.remember(hashes, req.prompt_ids)
        deadline = time.monotonic() + self.worker.settings.fetch_timeout_s
        await self._await_inflight(wanted, deadline)
        mine = [k for k in wanted if k not in self._inflight]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in mine:
            self._inflight[key] = done
        try:
            result = await self.client.fetch(
                leg.remote_host,
                leg.remote_port,
                leg.kv_request_id,
                wanted,
                deadline,
                expected_node_id=leg.remote_engine_id,
            )
        finally:
            for key in mine:
                if self._inflight.get(key) is done:
                    del self._inflight[key]
            done.set_result(None)
        self.stats.p2p_bytes_fetched += result.nbytes
        self.stats.p2p_blocks_fetched += len(result.fetched)
        if result.reason is not None:
            self.stats.p2p_fetch_failures += 1
            logger.warning(
                "request %s: fetch from %s:%d fell short (%s); recomputing the rest",
                req.request_id,
                leg.remote_host,
                leg.remote_port,
                result.reason,
            )
            self._release_in_background(leg)

        def available(group: int, block: int) -> bool:
            if self._on_device(hashes, group, block):
                return True
            return self.pool.lookup(offload_key(hashes[block], group)) is LookupResult.HIT

        hit = self.kv.hit_blocks(hashes, cap, has=available)
        await self._install(req, hashes, hit)

    def _release_in_background(self, leg: ConsumerLeg) -> None:
        """A fetch that fell short may end without its ``done`` (e.g. no free host page: the
        session is dropped mid-stream). The rest is recomputed, so tell the producer to drop
        the supply now rather than hold its pages until the lease ends. Off the request's path:
        a dead producer must not delay the answer."""
        client = self.client
        if client is None:
            return
        deadline = time.monotonic() + self.p2p.connect_timeout_s

        async def release() -> None:
            await client.release(
                leg.remote_host,
                leg.remote_port,
                leg.kv_request_id,
                deadline,
                expected_node_id=leg.remote_engine_id,
            )

        task = asyncio.create_task(release(), name=f"p2p-release {leg.kv_request_id}")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _await_inflight(self, keys: Sequence[OffloadKey], deadline: float) -> None:
        """Wait (bounded by ``deadline``) for other requests' fetches of any of ``keys``: a
        shared prefix is fetched once, and a concurrent fetch never races it for host pages."""
        pending = {id(f): f for k in keys if (f := self._inflight.get(k)) is not None}
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining > 0:
            await asyncio.wait(list(pending.values()), timeout=remaining)

    async def _finish_remote(self, leg: ConsumerLeg) -> None:
        """Nothing to fetch: tell the producer it may release the supply now."""
        if self.client is not None:
            await self.client.fetch(
                leg.remote_host,
                leg.remote_port,
                leg.kv_request_id,
                [],
                expected_node_id=leg.remote_engine_id,
            )

    def _on_device(self, hashes: Sequence[BlockHash], group: int, block: int) -> bool:
        return self.kv.pools[group].lookup(hashes[block]) is not None

    def _keys_for(
        self, hashes: Sequence[BlockHash], hit: int, present: Callable[[int, int], bool]
    ) -> list[OffloadKey]:
        """Keys of the blocks a hit of ``hit`` blocks reads that are not ``present``, in chunk
        order (block by block, groups within a block), so a gap cuts only what follows it."""
        wanted = [
            (b, pool.spec.index)
            for pool in self.kv.pools
            for b in self._needed(pool.spec.index, hit)
            if not present(pool.spec.index, b)
        ]
        return [offload_key(hashes[b], g) for b, g in sorted(wanted)]

    def _needed(self, group: int, hit: int) -> range:
        return needed_chunks(hit, self.layout.groups[group], self.layout)

    async def _install(self, req: EngineRequest, hashes: Sequence[BlockHash], hit: int) -> None:
        """Copy host pages of the hit's missing blocks into fresh device pages; pin them."""
        ctx = ReqContext(RequestId(f"consumer:{req.request_id}:{uuid.uuid4().hex[:8]}"), None)
        self.manager.on_new_request(ctx)
        try:
            for pool in self.kv.pools:
                g = pool.spec.index
                blocks = [b for b in self._needed(g, hit) if not self._on_device(hashes, g, b)]
                keys = [offload_key(hashes[b], g) for b in blocks]
                if not keys:
                    continue
                try:
                    spec = self.manager.prepare_load(keys, ctx)
                except KvtierError as exc:
                    logger.warning(
                        "request %s: host pages vanished before install: %s", req.request_id, exc
                    )
                    return
                try:
                    await self._install_group(req, g, hashes, blocks, spec.page_indices)
                finally:
                    self.manager.complete_load(keys, ctx)
        finally:
            self.manager.on_request_finished(ctx)

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
            page = self.kv.allocate_spare(group)
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
            await self._copy(group, CopyDirection.HOST_TO_DEVICE, device_pages, host_pages[:n])
        except KvtierError:
            logger.exception("request %s: host→GPU copy failed", req.request_id)
            return
        bs = self.kv.block_size
        for block, page in zip(blocks, device_pages, strict=False):
            parent = hashes[block - 1] if block > 0 else None
            tokens = req.prompt_ids[block * bs : (block + 1) * bs]
            self.kv.register(group, page, hashes[block], parent, tokens)


def p2p_connector_factory(worker: Worker) -> KVConnector:
    """Builds the connector from the worker's settings."""
    s = worker.settings
    p2p = P2PSettings(
        host=s.host,
        port=s.p2p_port,
        secret=s.p2p_secret if s.p2p_secret.get_secret_value() else None,
        fetch_timeout_s=s.fetch_timeout_s,
        lease_s=s.supply_lease_s,
    )
    return P2PConnector(worker, p2p)
