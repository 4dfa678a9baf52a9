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
hits; anything missing is simply recomputed (counted). :mod:`kvtier.worker.remote_prefix`.

Symmetric pull (``remote_kv_source``, alone or on a producer leg, before admission): the same,
with :meth:`P2PClient.pull` from the named holder (offer the keys the device lacks, fetch the run
the holder pinned, done). Every worker is a holder too (``p2p_holder``, on by default, any
role): its P2P server answers offers from its host pages and device blocks
(:mod:`kvtier.worker.holder`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvtier.errors import KvtierError
from kvtier.keys import OffloadKey, offload_key
from kvtier.offload.pool import HostPagePool
from kvtier.offload.scan import RequestChunks, plan_store
from kvtier.offload.tiering import TieringManager
from kvtier.offload.types import ReqContext, RequestId
from kvtier.offload.window import AttentionKind, ChunkLayout, GroupSpec
from kvtier.p2p.client import FetchResult, P2PClient
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
from kvtier.worker.holder import DeviceHoldings
from kvtier.worker.kv_cache import KVCache
from kvtier.worker.kv_params import ConsumerLeg, KvSource, ProducerLeg, producer_answer
from kvtier.worker.remote_prefix import RemotePrefix
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
        self.copiers = [
            PageCopier(DevicePages(p.storage), self.host, blocks_per_page=1) for p in self.kv.pools
        ]
        # A holder answers offers (remote_kv_source) whatever its role: any node may hold a
        # prefix another node wants. Consumer-only workers listen only to be holders.
        holdings = (
            DeviceHoldings(self.tier, self.pool, self.kv, self._copy)
            if settings.p2p_holder
            else None
        )
        self.server = (
            P2PServer(p2p, self.identity, self.registry, holdings=holdings)
            if settings.role in ("producer", "both") or holdings is not None
            else None
        )
        # Every role can pull (a producer leg may carry remote_kv_source too).
        self.client = P2PClient(p2p, self.identity, PoolSink(self.pool))
        self._copy_executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-page-copy")
        self.remote = RemotePrefix(
            kv=self.kv,
            pool=self.pool,
            manager=self.manager,
            layout=self.layout,
            copy_pages=self._copy,
            events=worker.events,
            fetch_timeout_s=settings.fetch_timeout_s,
        )
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
        if self.server is None or self.worker.settings.role == "consumer":
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
        req.expected_remote_blocks = self.kv.max_hit_blocks(len(req.prompt_ids), self.kv.block_size)
        if self.worker.settings.role == "producer":
            self.stats.kv_params_fallbacks += 1
            logger.warning(
                "request %s: consumer leg on a producer-only worker runs locally", req.request_id
            )
            return
        client = self.client

        async def fetch(wanted: list[OffloadKey], deadline: float) -> FetchResult:
            return await client.fetch(
                leg.remote_host,
                leg.remote_port,
                leg.kv_request_id,
                wanted,
                deadline,
                expected_node_id=leg.remote_engine_id,
            )

        results = await self.remote.bring(req, fetch)
        if results is None:
            await self._finish_remote(leg)
            return
        (result,) = results
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
            self._release_in_background(
                leg.remote_host, leg.remote_port, leg.kv_request_id, leg.remote_engine_id
            )

    async def pull_remote(self, req: EngineRequest, source: KvSource) -> None:
        client = self.client

        async def pull(wanted: list[OffloadKey], deadline: float) -> FetchResult:
            return await client.pull(
                source.remote_host,
                source.remote_port,
                wanted,
                expected_node_id=source.remote_engine_id,
                deadline=deadline,
            )

        results = await self.remote.bring(req, pull, rounds=2)
        if results is None:
            return  # the device holds every block the prompt can reuse: nothing to ask for
        self.stats.pull_requests += 1
        for result in results:
            self.stats.pull_bytes += result.nbytes
            self.stats.pull_blocks += len(result.fetched)
            if result.nbytes:  # what the router divides into bytes for its link speed
                self.stats.pull_seconds += result.elapsed_s
            if result.reason is not None and result.kv_request_id:
                # The holder pinned a supply that may not have got its done.
                self._release_in_background(
                    source.remote_host,
                    source.remote_port,
                    result.kv_request_id,
                    source.remote_engine_id,
                )
        first = results[0]
        if first.reason is None:
            return
        # A holder lacking the prompt's tail is the normal case, not a failure; transport,
        # verification and deadline problems are.
        if first.holder_short:
            self.stats.pull_short += 1
            logger.debug("request %s: %s", req.request_id, first.reason)
            return
        self.stats.pull_failures += 1
        logger.warning(
            "request %s: pull from %s:%d fell short (%s); recomputing the rest",
            req.request_id,
            source.remote_host,
            source.remote_port,
            first.reason,
        )

    def _release_in_background(
        self, host: str, port: int, kv_request_id: str, node_id: str | None
    ) -> None:
        """A fetch that fell short may end without its ``done`` (e.g. no free host page: the
        session is dropped mid-stream). The rest is recomputed, so tell the producer (or
        holder) to drop the supply now rather than hold its pages until the lease ends. Off
        the request's path: a dead peer must not delay the answer."""
        client = self.client
        deadline = time.monotonic() + self.p2p.connect_timeout_s

        async def release() -> None:
            await client.release(host, port, kv_request_id, deadline, expected_node_id=node_id)

        task = asyncio.create_task(release(), name=f"p2p-release {kv_request_id}")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _finish_remote(self, leg: ConsumerLeg) -> None:
        """Nothing to fetch: tell the producer it may release the supply now."""
        await self.client.fetch(
            leg.remote_host,
            leg.remote_port,
            leg.kv_request_id,
            [],
            expected_node_id=leg.remote_engine_id,
        )


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
