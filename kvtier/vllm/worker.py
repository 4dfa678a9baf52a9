"""Worker side of the kvtier connector: host pages, the tiering manager, the P2P server/client.

Lives in vLLM's worker process; built by ``KvtierConnector.register_kv_caches``. Mirrors the
reference worker's :class:`kvtier.worker.p2p_connector.P2PConnector`: the same
:class:`TieringManager` with a :class:`P2PTier` over a :class:`HostPagePool`, the same
``plan_store`` → ``prepare_store`` → copy → ``complete_store`` path for producer legs, and
:meth:`P2PClient.fetch` straight into host pages for consumer legs.

Threads:

- the **engine thread** (vLLM's model runner) calls :meth:`save`, :meth:`start_loads`,
  :meth:`take_results` and :meth:`stats`, between forward passes. They never wait on the
  network: a fetch runs on the network thread and is polled here; copies between vLLM's KV
  cache and host pages happen only here, so no forward pass races them.
- the **network thread** (:class:`NetworkThread`) runs the P2P server (serving supplies,
  answering ``remote_kv_source`` offers from the host pool, expiring leases) and the
  consumer's fetches, which write only host pages that are not yet
  readable (the pool's WRITING state) until verified.

The pool, manager and supply registry are thread-safe; nothing else is shared.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.errors import KvtierError, UnknownKey
from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.offload.pool import HostPagePool, PageRef
from kvtier.offload.scan import RequestChunks, plan_store
from kvtier.offload.tiering import TieringManager
from kvtier.offload.types import ReqContext, RequestId
from kvtier.offload.window import ChunkLayout, GroupSpec
from kvtier.p2p.client import FetchResult, P2PClient
from kvtier.p2p.handshake import LocalIdentity
from kvtier.p2p.offer import PoolHoldings
from kvtier.p2p.pool_pages import PoolSink
from kvtier.p2p.server import P2PServer
from kvtier.p2p.supply import SupplyRegistry
from kvtier.p2p.tier import P2PTier
from kvtier.pages import HostPages
from kvtier.vllm.copies import LayeredBlockCopier
from kvtier.vllm.layout import fingerprint_from_layers
from kvtier.vllm.loop import NetworkThread
from kvtier.vllm.metadata import LoadSpec, ReleaseSpec, SaveSpec
from kvtier.vllm.settings import KvtierConnectorSettings
from kvtier.vllm.stats import COUNTERS

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0
_GROUP = 0
"""vLLM's single KV-cache group (the connector refuses models with several)."""


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    keys: tuple[OffloadKey, ...]
    future: concurrent.futures.Future[FetchResult]


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """One finished load, as :meth:`KvtierWorker.take_results` reports it."""

    req_id: str
    installed: int
    """Leading blocks of the load now in vLLM's KV cache."""
    failed_block_ids: tuple[int, ...]
    """vLLM blocks of the load that were not installed (vLLM recomputes from the first)."""


@dataclass(slots=True)
class _Counters:
    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    reported: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    gauges: dict[str, float] = field(default_factory=dict)


class KvtierWorker:
    """One vLLM worker's kvtier state (see the module docstring for threads)."""

    def __init__(
        self,
        settings: KvtierConnectorSettings,
        layers: Sequence[torch.Tensor],
        *,
        engine_id: str,
        block_size: int,
        hash_seed: str,
        produces: bool,
        consumes: bool,
    ) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.fingerprint = fingerprint_from_layers(hash_seed, block_size, layers)
        page_nbytes = self.fingerprint.page_bytes[0]
        self.host = HostPages(settings.host_pages, page_nbytes)
        self.pool = HostPagePool(self.host)
        self.copier = LayeredBlockCopier(layers, self.host)
        self.layout = ChunkLayout(block_size, 1, (GroupSpec(_GROUP),))
        p2p = settings.p2p_settings()
        self.p2p = p2p
        self.registry = SupplyRegistry(p2p.lease_s, released_memory=p2p.released_memory)
        self.tier = P2PTier(self.pool, self.registry, self.fingerprint)
        self.manager = TieringManager(self.pool, [self.tier])
        self.identity = LocalIdentity.from_settings(engine_id, self.fingerprint, p2p)
        # Any node with a server is also a holder: it answers remote_kv_source offers from
        # its host pages (blocks only in vLLM's KV cache cannot be offered, see docs/vllm.md).
        self.server = (
            P2PServer(p2p, self.identity, self.registry, holdings=PoolHoldings(self.tier))
            if produces
            else None
        )
        self.client = P2PClient(p2p, self.identity, PoolSink(self.pool)) if consumes else None
        self.net = NetworkThread("kvtier-p2p")
        self._loads: dict[str, _Load] = {}
        self._background: set[concurrent.futures.Future[bool]] = set()
        self._counters = _Counters()
        self.net.start()
        if self.server is not None:
            self.net.run(self.server.start(), _START_TIMEOUT_S)
            logger.info(
                "kvtier P2P server %s on %s:%d (%d host pages of %d bytes)",
                engine_id,
                p2p.host,
                self.server.port,
                settings.host_pages,
                page_nbytes,
            )

    def shutdown(self) -> None:
        """vLLM's ``shutdown`` (engine thread, worker exit): stop serving, drop every supply,
        stop the network thread. Bounded by a few seconds whatever peers do."""
        try:
            if self.server is not None:
                self.net.run(self.server.stop(), _STOP_TIMEOUT_S)
            if self.client is not None:
                self.net.run(self.client.close(), _STOP_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, KvtierError, OSError) as exc:
            logger.warning("kvtier shutdown: %r", exc)
        finally:
            self.net.stop(_STOP_TIMEOUT_S)
            self.registry.close()
            self.tier.close()
            self.manager.close()

    # -- producer (engine thread, wait_for_save) -----------------------------------------------

    def save(self, spec: SaveSpec) -> None:
        """Supply every full block of a producer leg under its kv_request_id: blocks the host
        tier holds cascade without a copy, blocks being written elsewhere are parked, the rest
        are copied from vLLM's KV cache now. Returns when the supply is registered and finished
        (demand for anything else then fails at once). Without a kv_request_id
        (``offload_prompts``), only copies the blocks the host pages lack.

        Called by ``KvtierConnector.wait_for_save`` on the engine thread, after the forward pass
        of the step that completed the prompt and before that step's output leaves the worker
        (so the supply exists before the producer answers). Must not wait on the network."""
        supplying = spec.kv_request_id is not None
        params = {"remote_decoder": {"kv_request_id": spec.kv_request_id}} if supplying else {}
        started = time.perf_counter()
        rid = RequestId(f"producer:{spec.req_id}:{uuid.uuid4().hex[:8]}")
        ctx = ReqContext(rid, params)
        self.manager.on_new_request(ctx)
        try:
            chunks = RequestChunks.from_block_hashes(
                self.layout, spec.block_hashes, spec.num_tokens
            )
            plan = plan_store(chunks, self.layout, request_level=ctx.is_request_level)
            out = self.manager.prepare_store(plan.keys, ctx, cascade_only=plan.cascade_only)
            block_of = {
                offload_key(BlockHash(h), _GROUP): b
                for h, b in zip(spec.block_hashes, spec.block_ids, strict=True)
            }
            ok = True
            try:
                self.copier.to_host(
                    [block_of[k] for k in out.keys_to_store], out.store_spec.page_indices
                )
            except (RuntimeError, IndexError) as exc:
                ok = False
                logger.exception("request %s: KV→host copy failed: %s", spec.req_id, exc)
            self.manager.complete_store(out.keys_to_store, ctx, ok)
            copied = len(out.keys_to_store) if ok else 0
            if supplying:
                self._count("blocks_supplied", len(plan.keys) + len(plan.cascade_only))
                self._count("blocks_stored", copied)
            else:
                self._count("blocks_offloaded", copied)
                self._count("offload_seconds", time.perf_counter() - started)
        finally:
            self.manager.on_request_finished(ctx)

    # -- consumer (engine thread, start_load_kv / get_transfer_results) -----------------------

    def start_loads(self, loads: Sequence[LoadSpec], releases: Sequence[ReleaseSpec]) -> None:
        """Start this step's fetches and releases on the network thread; returns at once.

        Called by ``KvtierConnector.start_load_kv`` on the engine thread, once per step. Never
        touches vLLM's KV cache (the fetch writes host pages only); never blocks."""
        client = self.client
        if client is None:
            for spec in loads:  # a consumer leg on a producer-only worker: recompute all
                self._loads[spec.req_id] = _Load(spec, (), _failed("not a consumer"))
            return
        for spec in loads:
            keys = tuple(offload_key(BlockHash(h), _GROUP) for h in spec.block_hashes)
            deadline = time.monotonic() + self.settings.fetch_timeout_s
            future = self.net.submit(
                client.fetch(
                    spec.remote_host,
                    spec.remote_port,
                    spec.kv_request_id,
                    keys,
                    deadline,
                    expected_node_id=spec.remote_engine_id,
                )
            )
            self._loads[spec.req_id] = _Load(spec, keys, future)
        for rel in releases:
            self._release(rel)

    def _release(self, rel: ReleaseSpec) -> None:
        """Tell a producer to drop a supply, off the engine thread (a dead producer must not
        delay anything)."""
        if self.client is None:
            return
        deadline = time.monotonic() + self.p2p.connect_timeout_s
        done = self.net.submit(
            self.client.release(
                rel.remote_host,
                rel.remote_port,
                rel.kv_request_id,
                deadline,
                expected_node_id=rel.remote_engine_id,
            )
        )
        self._background.add(done)
        done.add_done_callback(self._background.discard)

    def take_results(self) -> list[LoadOutcome]:
        """Install every fetch that has ended (fully, partly or not at all) into its vLLM
        blocks and report it. A fetch ends by its deadline (the client guarantees it).

        Called by ``KvtierConnector.get_transfer_results`` on the engine thread, once per step,
        after the forward pass: the blocks it writes belong to requests vLLM holds in
        WAITING_FOR_REMOTE_KVS, which no forward pass reads. Polls futures; never waits."""
        outcomes = []
        for req_id in [r for r, load in self._loads.items() if load.future.done()]:
            load = self._loads.pop(req_id)
            usable = self._usable(load)
            installed = self._install(load, usable)
            failed = load.spec.block_ids[installed:]
            self._count("blocks_loaded", installed)
            self._count("blocks_recomputed", len(failed))
            outcomes.append(LoadOutcome(req_id, installed, tuple(failed)))
        return outcomes

    def _usable(self, load: _Load) -> int:
        try:
            result = load.future.result()
        except Exception:  # a bug in the fetch path: recompute, never crash the engine
            logger.exception("request %s: fetch failed", load.spec.req_id)
            self._count("fetch_failures", 1)
            return 0
        self._count("fetch_bytes", result.nbytes)
        self._count("fetch_seconds", result.elapsed_s)
        self._count("blocks_fetched", len(result.fetched))
        if result.reason is not None:
            self._count("fetch_failures", 1)
            logger.warning(
                "request %s: fetch of %s from %s:%d fell short after %d of %d blocks (%s); "
                "vLLM recomputes from prompt block %d",
                load.spec.req_id,
                load.spec.kv_request_id,
                load.spec.remote_host,
                load.spec.remote_port,
                result.usable,
                len(load.keys),
                result.reason,
                load.spec.first_block + result.usable,
            )
            # A fetch that fell short may end without its ``done``: release the supply now
            # rather than let it hold the producer's pages until the lease ends.
            spec = load.spec
            self._release(
                ReleaseSpec(
                    spec.kv_request_id, spec.remote_host, spec.remote_port, spec.remote_engine_id
                )
            )
        return result.usable

    def _install(self, load: _Load, usable: int) -> int:
        """Copy the leading ``usable`` fetched pages into the load's vLLM blocks; returns how
        many were installed (a page evicted since the fetch ends the prefix there)."""
        refs: list[PageRef] = []
        try:
            for key in load.keys[:usable]:
                try:
                    refs.append(self.pool.acquire(key))
                except UnknownKey:
                    break
            n = len(refs)
            try:
                self.copier.to_device([r.index for r in refs], load.spec.block_ids[:n])
            except (RuntimeError, IndexError):
                logger.exception("request %s: host→KV copy failed", load.spec.req_id)
                return 0
            return n
        finally:
            for ref in refs:
                ref.release()

    # -- telemetry (engine thread) -------------------------------------------------------------

    def _count(self, name: str, value: float) -> None:
        self._counters.values[name] += value

    def stats(self) -> dict[str, float] | None:
        """Counter deltas since the last call and current gauges; None when nothing changed.

        Called by ``KvtierConnector.get_kv_connector_stats`` on the engine thread each step;
        waits at most a fraction of a second for the network thread's task count."""
        c = self._counters
        offers = self.server.offers if self.server is not None else None
        if offers is not None:  # the holder desk keeps totals; report them as deltas too
            answered = offers.stats()
            c.values["offers_answered"] = float(answered.offers_total)
            c.values["blocks_offered"] = float(answered.offered_keys_total)
        deltas = {k: v - c.reported[k] for k, v in c.values.items() if v != c.reported[k]}
        c.reported = dict(c.values)
        supply = self.registry.stats()
        gauges = {
            "supplies": float(supply.requests),
            "supply_pages": float(supply.held_pages),
            "host_referenced_pages": float(self.pool.stats().referenced),
            "loads_in_flight": float(len(self._loads)),
        }
        if deltas or gauges != {k: c.gauges.get(k) for k in gauges}:
            gauges["network_tasks"] = float(self.net.tasks())
        else:
            return None
        c.gauges = gauges
        return {**deltas, **gauges}


def _failed(reason: str) -> concurrent.futures.Future[FetchResult]:
    future: concurrent.futures.Future[FetchResult] = concurrent.futures.Future()
    future.set_exception(KvtierError(reason))
    return future
