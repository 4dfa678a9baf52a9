"""Scheduler side of the kvtier connector: which requests move KV, and what the worker must do.

Runs in vLLM's engine-core process, on the scheduler's thread (every method below is called by
``vllm.v1.core.sched.scheduler.Scheduler`` while it holds no lock of ours: none exists, the
scheduler is single-threaded). Nothing here touches KV memory or waits: each method returns at
once, and the worker side does the moving. The only network use is the offers of
``remote_kv_source`` legs, which run on the :class:`~kvtier.vllm.offers.OfferDesk`'s own thread
and are polled from here.

Legs (``kv_transfer_params``, parsed by :func:`kvtier.worker.kv_params.parse_leg`):

- producer leg (``{"remote_decoder": {"kv_request_id": K}}``): in the step whose tokens complete
  the prompt, :meth:`build_connector_meta` hands the worker every full block of the prompt (the
  block table includes prefix-cache hits, which ``save_kv_layer`` never sees); the worker supplies
  them under K before the step's output reaches this side. :meth:`request_finished` then answers
  ``{"remote_host", "remote_port", "kv_request_id", "num_blocks", "remote_engine_id"}``.
- consumer leg (``{"remote_prefiller": {...}}``): :meth:`get_num_new_matched_tokens` reports the
  producer's full prompt blocks past the consumer's own prefix-cache hit, loaded asynchronously;
  :meth:`update_state_after_alloc` turns the allocated blocks into a fetch for the worker. A leg
  with nothing to fetch (short prompt, local hit) releases the producer's supply instead.
- ``remote_kv_source`` leg (``{"remote_kv_source": {"remote_host", "remote_port",
  "remote_engine_id"}}``, see :mod:`kvtier.vllm.offers`): :meth:`get_num_new_matched_tokens`
  starts an offer of the prompt's block keys to the holder on the scheduler process's network
  thread and answers ``(None, False)`` ("ask again next step") until the holder has answered;
  then the held run past the local hit, loaded asynchronously under the holder's fresh
  ``kv_request_id`` by the same worker fetch as a consumer leg. It may come with a producer leg
  (the pulled blocks are then supplied too); with a consumer leg the params are malformed
  (``kvtier.worker.kv_params`` parses the leg) and the request runs plainly.
- a leg naming a peer (a consumer leg's producer, a ``remote_kv_source`` holder) outside
  ``kv_source_allowed_peers`` is refused when the request arrives, by the reference worker's
  check (:meth:`kvtier.worker.peers.PeerAllowlist.refused`): the request runs without it (a
  producer leg keeps its supply and only loses the pull), so no load, offer or release ever
  connects there.
- any other request, under ``offload_prompts``: its full prompt blocks go to the worker's host
  pages in the step that completes the prompt (a save without a supply), so this node can
  answer offers for prompts it computed alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError
from kvtier.keys import BlockHash, BlockHasher, offload_key
from kvtier.vllm.metadata import KvtierConnectorMetadata, LoadSpec, ReleaseSpec, SaveSpec
from kvtier.vllm.offers import OfferDesk, tokens_to_load
from kvtier.vllm.settings import KvtierConnectorSettings
from kvtier.worker.kv_params import (
    ConsumerLeg,
    KvSource,
    Leg,
    ProducerLeg,
    parse_leg,
    producer_answer,
    pull_source,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Producer:
    """A request whose prompt blocks go to host pages once computed: a producer leg's supply,
    or (``leg`` None) a plain request under ``offload_prompts``."""

    request: Request
    leg: ProducerLeg | None
    num_blocks: int = 0
    saved: bool = False


class KvtierScheduler:
    """Scheduler-side state of one engine (see the module docstring for who calls what)."""

    def __init__(
        self,
        settings: KvtierConnectorSettings,
        *,
        engine_id: str,
        block_size: int,
        hash_seed: str,
        produces: bool,
        consumes: bool,
        offers: OfferDesk | None = None,
    ) -> None:
        self.settings = settings
        self._peers = settings.allowed_peers()
        self.offers = offers
        """Offers of ``remote_kv_source`` legs (None: such legs run plainly)."""
        self.engine_id = engine_id
        self.block_size = block_size
        self.hasher = BlockHasher(hash_seed, block_size)
        self.produces = produces
        self.consumes = consumes
        self._kv_cache_manager: KVCacheManager | None = None
        self._producers: dict[str, _Producer] = {}
        self._consumers: dict[str, ConsumerLeg] = {}
        self._sources: dict[str, KvSource] = {}
        self._tried: set[str] = set()
        """Consumer legs whose load was planned once: never again (a failed load recomputes)."""
        self._loading: set[str] = set()
        """Loads handed to the worker and not yet reported finished: their blocks stay held."""
        self._loads: list[LoadSpec] = []
        self._releases: list[ReleaseSpec] = []

    def bind(self, kv_cache_manager: KVCacheManager) -> None:
        """Called once by the connector's ``bind_kv_cache_manager`` (scheduler construction)."""
        self._kv_cache_manager = kv_cache_manager

    # -- admission ------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """``Scheduler.add_request``: parse the leg once; malformed params run the request
        plainly (logged)."""
        leg = self._allowed(request.request_id, self._parse(request))
        source = pull_source(leg)
        if source is not None:
            if self.offers is not None:
                self._sources[request.request_id] = source
            else:
                logger.warning(
                    "request %s: remote_kv_source on a connector that does not consume; "
                    "it computes the prompt itself",
                    request.request_id,
                )
        if isinstance(leg, ProducerLeg) and self.produces:
            self._producers[request.request_id] = _Producer(request, leg)
        elif isinstance(leg, ConsumerLeg) and self.consumes:
            self._consumers[request.request_id] = leg
        elif isinstance(leg, ProducerLeg | ConsumerLeg):
            logger.warning(
                "request %s: a %s leg on a connector that does not %s; it runs plainly",
                request.request_id,
                "producer" if isinstance(leg, ProducerLeg) else "consumer",
                "produce" if isinstance(leg, ProducerLeg) else "consume",
            )
        if (
            self.settings.offload_prompts
            and self.produces
            and request.prompt_token_ids
            and request.request_id not in self._producers
        ):
            # Any other request (a consumer leg's fetched blocks are in host pages already:
            # they cascade without a copy) stores its prompt once computed.
            self._producers[request.request_id] = _Producer(request, None)

    def _parse(self, request: Request) -> Leg | None:
        params = request.kv_transfer_params
        if not isinstance(params, Mapping) or request.prompt_token_ids is None:
            return None
        try:
            return parse_leg(params, request.request_id)
        except KvtierError as exc:
            logger.warning("request %s: kv_transfer_params ignored: %s", request.request_id, exc)
            return None

    def _allowed(self, req_id: str, leg: Leg | None) -> Leg | None:
        """``leg`` as this engine may run it: without the peer it names when that peer is not in
        ``kv_source_allowed_peers`` (a producer leg keeps its supply, any other leg is gone)."""
        refused = self._peers.refused(leg)
        if refused is None:
            return leg
        logger.warning(
            "request %s: %s is not in kv_source_allowed_peers; the prompt is computed here",
            req_id,
            refused,
        )
        return dataclasses.replace(leg, source=None) if isinstance(leg, ProducerLeg) else None

    def _hashes(self, request: Request) -> list[BlockHash]:
        assert request.prompt_token_ids is not None
        return self.hasher.hash_tokens(request.prompt_token_ids, cache_salt=request.cache_salt)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens the producer supplies beyond the local hit ``num_computed_tokens`` (block
        aligned), loaded asynchronously. Side-effect free (vLLM may ask several times), but for
        a ``remote_kv_source`` leg's first ask, which starts its offer (then ``None``: "not
        known yet", until the holder answered or the offer's deadline passed)."""
        req_id = request.request_id
        if req_id in self._tried:
            return 0, False
        source = self._sources.get(req_id)
        if source is not None:
            return self._held_tokens(request, source, num_computed_tokens)
        if req_id not in self._consumers:
            return 0, False
        count = self._supply_end(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _held_tokens(
        self, request: Request, source: KvSource, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.offers is not None
        num_full_blocks = self._supply_end(request) // self.block_size
        if num_full_blocks * self.block_size <= num_computed_tokens:
            return 0, False  # the local hit covers every block a holder could have
        keys = [offload_key(h, 0) for h in self._hashes(request)[:num_full_blocks]]
        offer = self.offers.ask(request.request_id, source, keys)
        if offer is None:
            return None, False
        count = tokens_to_load(
            offer,
            num_computed_tokens=num_computed_tokens,
            num_full_blocks=num_full_blocks,
            block_size=self.block_size,
        )
        return (count, True) if count > 0 else (0, False)

    def _supply_end(self, request: Request) -> int:
        """Tokens the producer can supply: every full block of the prompt (only full blocks
        have keys; vLLM recomputes the last token of a fully loaded prompt itself)."""
        num_tokens: int = request.num_prompt_tokens
        return num_tokens // self.block_size * self.block_size

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Blocks are allocated: plan the fetch of the external range (or the release)."""
        req_id = request.request_id
        if req_id in self._tried:
            return
        leg = self._consumers.get(req_id)
        source = self._sources.get(req_id)
        # The external range ends where get_num_new_matched_tokens said it does (vLLM starts
        # it at the local hit; the request's num_computed_tokens is set only after this call).
        end = self._supply_end(request) // self.block_size
        if leg is not None:
            self._tried.add(req_id)
            supply = ReleaseSpec(
                leg.kv_request_id, leg.remote_host, leg.remote_port, leg.remote_engine_id
            )
        elif source is not None and self.offers is not None:
            offer = self.offers.claim(req_id)  # the pinned supply is ours from here on
            if offer is None:
                return  # admitted without asking (the local hit covered the prompt)
            self._tried.add(req_id)
            if offer.kv_request_id is None:
                return
            end = min(end, offer.num_held)
            supply = ReleaseSpec(
                offer.kv_request_id,
                source.remote_host,
                source.remote_port,
                source.remote_engine_id,
            )
        else:
            return
        if num_external_tokens <= 0:
            self._releases.append(supply)
            return
        first = end - num_external_tokens // self.block_size
        hashes = self._hashes(request)[first:end]
        block_ids = blocks.get_block_ids()[0][first:end]
        self._loads.append(
            LoadSpec(
                req_id,
                supply.kv_request_id,
                supply.remote_host,
                supply.remote_port,
                supply.remote_engine_id,
                first,
                tuple(hashes),
                tuple(block_ids),
            )
        )
        self._loading.add(req_id)

    # -- each step ------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        """End of ``Scheduler.schedule``: this step's loads, releases, and the saves of producer
        legs whose prompt this step completes (``num_computed_tokens`` is still pre-step)."""
        meta = KvtierConnectorMetadata(loads=self._loads, releases=self._releases)
        self._loads, self._releases = [], []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            producer = self._producers.get(req_id)
            if producer is None or producer.saved:
                continue
            request = producer.request
            if request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue  # a chunked prefill: not complete yet
            producer.saved = True
            hashes = self._hashes(request)
            producer.num_blocks = len(hashes)
            if not hashes:
                continue  # shorter than a block: nothing has a key, the consumer computes all
            assert self._kv_cache_manager is not None
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0][: len(hashes)]
            hashes = hashes[: len(block_ids)]  # both describe the same blocks, one for one
            producer.num_blocks = len(hashes)
            meta.saves.append(
                SaveSpec(
                    req_id,
                    None if producer.leg is None else producer.leg.kv_request_id,
                    request.num_prompt_tokens,
                    tuple(hashes),
                    tuple(block_ids),
                )
            )
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """``Scheduler.update_from_output``: loads the worker finished (or failed) release
        their hold on the request's blocks."""
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        """Once per request, before vLLM frees its blocks. A consumer leg whose fetch is still
        in flight keeps its blocks (the worker installs into them) until the worker reports it;
        a producer leg whose blocks were supplied answers with where to fetch them."""
        req_id = request.request_id
        leg = self._consumers.pop(req_id, None)
        if leg is not None and req_id not in self._tried:
            # Finished before its load was planned (aborted while queued): the producer's
            # supply is not needed, release it now rather than at the end of its lease.
            self._releases.append(
                ReleaseSpec(
                    leg.kv_request_id, leg.remote_host, leg.remote_port, leg.remote_engine_id
                )
            )
        if self._sources.pop(req_id, None) is not None and self.offers is not None:
            self.offers.drop(req_id)  # an offer never claimed: release what the holder pinned
        self._tried.discard(req_id)
        producer = self._producers.pop(req_id, None)
        if req_id in self._loading:
            return True, None
        if (
            producer is None
            or producer.leg is None
            or not producer.saved
            or not _finished_normally(request)
        ):
            return False, None
        answer = producer_answer(
            producer.leg,
            host=self.settings.advertised_host,
            port=self.settings.p2p_port,
            num_blocks=producer.num_blocks,
            block_ids=block_ids,
            engine_id=self.engine_id,
        )
        return False, answer


def _finished_normally(request: Request) -> bool:
    from vllm.v1.request import RequestStatus

    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
