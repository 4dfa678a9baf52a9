"""``KvtierConnector``: kvtier as a vLLM KV connector (``KVConnectorBase_V1``).

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"p2p_port": 7701}}'

(``kvtier`` importable in vLLM's interpreter; ``KVTIER_P2P_SECRET`` in its environment on any
non-loopback network). pdproxy's ``p2p`` dialect drives it unchanged: producer legs carry
``{"remote_decoder": {"kv_request_id": K}}``, consumer legs ``{"remote_prefiller": {"kv_request_id":
K, "remote_host": H, "remote_port": P, "remote_engine_id": E}}``. A request with
``{"remote_kv_source": {"remote_host": H, "remote_port": P, "remote_engine_id": E}}`` pulls the
blocks that node holds in its kvtier host pages (:mod:`kvtier.vllm.offers`).

vLLM builds two instances of this class per engine, and the split is vLLM's:

- role ``SCHEDULER`` (engine-core process, scheduler thread) → :class:`KvtierScheduler`, and
  on a consumer an :class:`OfferDesk` whose own network thread (``kvtier-offers``) runs the
  offers of ``remote_kv_source`` legs (the scheduler thread only polls them);
- role ``WORKER`` (each worker process, model-runner thread) → :class:`KvtierWorker`, built in
  :meth:`KvtierConnector.register_kv_caches` once vLLM has allocated the KV cache.

Who calls what, and when (all on vLLM's own thread for that role; none of these may block on
the network, and none may raise for a transfer failure — failures become recomputation):

==============================  ==========================================================
scheduler side                  called by the scheduler
==============================  ==========================================================
``on_new_request``              ``add_request``: parse the leg
``get_num_new_matched_tokens``  admission, possibly several times: side-effect free (but
                                a ``remote_kv_source`` leg's first ask starts its offer and
                                answers ``None``, "ask again next step", until it ends)
``update_state_after_alloc``    after blocks are allocated for an admitted request
``build_connector_meta``        end of ``schedule()``: the step's saves/loads/releases
``update_connector_output``     ``update_from_output``: finished loads
``request_finished``            once per request, before its blocks are freed
``shutdown``                    engine shutdown: release offers nobody fetched
==============================  ==========================================================

==============================  ==========================================================
worker side                     called by the model runner around each forward pass
==============================  ==========================================================
``register_kv_caches``          once, after KV cache allocation: builds the worker state
``start_load_kv``               each step (before or after the forward): starts fetches
``wait_for_save``               each step, after the forward: supplies finished prompts
``get_transfer_results``        each step: installs ended fetches, reports them
``get_block_ids_with_load_errors``  right after: blocks vLLM must recompute
``get_kv_connector_stats``      each step: telemetry (see :mod:`kvtier.vllm.stats`)
``shutdown``                    worker exit
==============================  ==========================================================

``save_kv_layer`` / ``wait_for_layer_load`` do nothing: saving per layer would miss the
prefix-cache hits that a producer must also supply, so the whole prompt is copied (only the
blocks the host tier lacks) once the step that completes it has run.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.p2p.client import P2PClient
from kvtier.p2p.handshake import LocalIdentity
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.vllm.errors import KvtierConnectorConfigError
from kvtier.vllm.layout import fingerprint_from_config
from kvtier.vllm.loop import NetworkThread
from kvtier.vllm.metadata import KvtierConnectorMetadata
from kvtier.vllm.offers import NoPages, OfferDesk
from kvtier.vllm.scheduler import KvtierScheduler
from kvtier.vllm.settings import KvtierConnectorSettings
from kvtier.vllm.stats import KvtierConnectorStats, KvtierPromMetrics
from kvtier.vllm.worker import KvtierWorker

if TYPE_CHECKING:
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


_OFFER_CLOSE_TIMEOUT_S = 2.0


def _open_offer_desk(
    settings: KvtierConnectorSettings, engine_id: str, fingerprint: LayoutFingerprint
) -> OfferDesk:
    """The scheduler side's offers: a P2P client (no pages: it only offers and releases) on
    its own network thread in the engine-core process."""
    p2p = settings.p2p_settings()
    client = P2PClient(p2p, LocalIdentity.from_settings(engine_id, fingerprint, p2p), NoPages())
    net = NetworkThread("kvtier-offers")
    net.start()

    def stop() -> None:
        try:
            net.run(client.close(), _OFFER_CLOSE_TIMEOUT_S)
        except Exception as exc:  # shutdown goes on whatever the loop did
            logger.warning("kvtier offers: client not closed: %r", exc)
        net.stop(_OFFER_CLOSE_TIMEOUT_S)

    return OfferDesk(
        client,
        net,
        offer_timeout_s=settings.offer_timeout_s,
        release_timeout_s=p2p.connect_timeout_s,
        on_close=stop,
    )


class KvtierConnector(KVConnectorBase_V1):
    """The facade vLLM instantiates; forwards to the scheduler or worker side."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = KvtierConnectorSettings.from_extra_config(
            transfer.kv_connector_extra_config
        )
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise KvtierConnectorConfigError(
                f"KvtierConnector supports one KV-cache group; this model has {len(groups)}"
            )
        self.layer_names = tuple(groups[0].layer_names)
        self.produces = bool(transfer.is_kv_producer)
        self.consumes = bool(transfer.is_kv_consumer)
        if self.produces and self.settings.p2p_port == 0:
            raise KvtierConnectorConfigError(
                "a producer needs a fixed p2p_port in kv_connector_extra_config: the scheduler "
                "process names it in its answers, the worker process listens on it"
            )
        if self.consumes and transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "kv_load_failure_policy is %r: a fetch that falls short fails the request; set "
                '"kv_load_failure_policy": "recompute" to recompute the missing blocks',
                transfer.kv_load_failure_policy,
            )
        assert transfer.engine_id is not None
        self.engine_id = str(transfer.engine_id)
        self.block_size = int(vllm_config.cache_config.block_size)
        served = vllm_config.model_config.served_model_name
        default_seed = served if isinstance(served, str) else vllm_config.model_config.model
        self.hash_seed = self.settings.hash_seed or f"vllm/{default_seed}"
        self.fingerprint = fingerprint_from_config(self.hash_seed, self.block_size, kv_cache_config)
        self._scheduler: KvtierScheduler | None = None
        self._worker: KvtierWorker | None = None
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = KvtierScheduler(
                self.settings,
                engine_id=self.engine_id,
                block_size=self.block_size,
                hash_seed=self.hash_seed,
                produces=self.produces,
                consumes=self.consumes,
                offers=_open_offer_desk(self.settings, self.engine_id, self.fingerprint)
                if self.consumes
                else None,
            )

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Model runner, once: build host pages, manager, P2P server/client over the group's
        layers (in the group's layer order, which both ends share)."""
        layers = [kv_caches[name] for name in self.layer_names]
        self._worker = KvtierWorker(
            self.settings,
            layers,
            engine_id=self.engine_id,
            block_size=self.block_size,
            hash_seed=self.hash_seed,
            produces=self.produces,
            consumes=self.consumes,
        )
        mismatch = self._worker.fingerprint.mismatch(self.fingerprint)
        if mismatch is not None:  # the scheduler's offers would be refused by every holder
            raise KvtierConnectorConfigError(
                f"the KV cache tensors disagree with vLLM's KV-cache spec: {mismatch}"
            )

    def _meta(self) -> KvtierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            meta = self._meta()
            self._worker.start_loads(meta.loads, meta.releases)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous and whole-request (installed between steps)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole prompts are supplied in wait_for_save (prefix hits included)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            for spec in self._meta().saves:
                self._worker.save(spec)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = KVConnectorTransferResults()
        if self._worker is None:
            return results
        for outcome in self._worker.take_results():
            results.finished_recving.add(outcome.req_id)
            self._load_errors.update(outcome.failed_block_ids)
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        data = self._worker.stats()
        return None if data is None else KvtierConnectorStats(data=data)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._scheduler is not None and self._scheduler.offers is not None:
            self._scheduler.offers.close(_OFFER_CLOSE_TIMEOUT_S)

    # -- scheduler side ------------------------------------------------------------------------

    def _sched(self) -> KvtierScheduler:
        assert self._scheduler is not None, "scheduler-side method on a worker-side connector"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._sched().bind(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, answer = self._sched().request_finished(request, block_ids)
        return delay, answer

    # -- telemetry classes ---------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
