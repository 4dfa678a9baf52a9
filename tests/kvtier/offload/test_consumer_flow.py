"""Producer → consumer through two managers and a linking tier: the load path end to end.

The linking tier stands in for P2P: on the producer it is the request-level tier that keeps
references on what it is offered; on the consumer it answers lookups for keys the producer
supplied, promotes them into the consumer's pool on demand and fails the rest explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.keys import BlockHasher, OffloadKey
from kvtier.offload import (
    AttentionKind,
    BytearrayPageBuffer,
    ChunkLayout,
    GroupSpec,
    HostPagePool,
    LookupResult,
    PageRef,
    ReqContext,
    RequestChunks,
    RequestId,
    RequestOffloadingContext,
    SecondaryTier,
    StoreFailure,
    TieringManager,
    TierName,
    load_scan_end,
    plan_store,
    producer_leg_policy,
    scan_request,
)
from tests.kvtier.offload.recording_tier import PRODUCER

NBYTES = 32


class Link(SecondaryTier):
    """Producer side: holds references on its supply. Consumer side: promotes from the peer."""

    def __init__(self, pool: HostPagePool, peer: Link | None = None) -> None:
        self.pool = pool
        self.peer = peer
        self.supply: dict[OffloadKey, PageRef] = {}
        self.failed: dict[OffloadKey, StoreFailure] = {}
        self.fetching: list[OffloadKey] = []
        self.demanded: list[OffloadKey] = []

    @property
    def name(self) -> TierName:
        return TierName("link")

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(producer_leg_policy(ctx.kv_transfer_params))

    def accepts_store(self, key: OffloadKey, ctx: ReqContext) -> bool:
        return False

    def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for k in keys:
            self.supply[k] = self.pool.acquire(k)

    def on_store_failed(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, reason: StoreFailure
    ) -> None:
        self.failed.update(dict.fromkeys(keys, reason))

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if self.peer is None or key in self.fetching:
            return LookupResult.RETRY if key in self.fetching else LookupResult.MISS
        self.demanded.append(key)
        return LookupResult.HIT if key in self.peer.supply else LookupResult.MISS

    def submit_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.fetching.extend(keys)

    def deliver(self) -> None:
        """The transfer: peer page bytes into freshly allocated pages here."""
        assert self.peer is not None
        for k in self.fetching:
            self.pool.allocate(k)
            self.pool.write_view(k)[:] = self.peer.supply[k].view
            self.pool.complete_write(k, True)
        self.fetching.clear()

    def on_request_finished(self, ctx: ReqContext) -> None:
        return

    def release(self) -> None:
        for ref in self.supply.values():
            ref.release()
        self.supply.clear()


def test_consumer_loads_the_whole_range_from_a_warm_producer() -> None:
    layout = ChunkLayout(4, 2, (GroupSpec(0), GroupSpec(1, AttentionKind.SLIDING_WINDOW, 12)))
    num_tokens = 8 * 20 + 5
    hashes = BlockHasher("m", 4).hash_tokens(list(range(num_tokens)))
    req = RequestChunks.from_block_hashes(layout, hashes, num_tokens)

    producer_pool = HostPagePool(BytearrayPageBuffer(64, NBYTES))
    producer_link = Link(producer_pool)
    producer = TieringManager(producer_pool, [producer_link])
    # a warm producer: an earlier plain request already stored the first 12 chunks
    warmer = ReqContext(RequestId("warmer"))
    producer.on_new_request(warmer)
    early = [k for keys in req.keys for k in keys[:12]]
    out = producer.prepare_store(early, warmer)
    for k in out.keys_to_store:
        producer_pool.write_view(k)[:] = k[:16] * 2
    producer.complete_store(out.keys_to_store, warmer, True)
    producer.on_request_finished(warmer)

    leg = ReqContext(RequestId("prefill"), PRODUCER)
    producer.on_new_request(leg)
    plan = plan_store(req, layout, request_level=leg.is_request_level)
    out = producer.prepare_store(plan.keys, leg, cascade_only=plan.cascade_only)
    assert not set(out.keys_to_store) & set(early)  # warm chunks are not copied again
    for k in out.keys_to_store:
        producer_pool.write_view(k)[:] = k[:16] * 2
    producer.complete_store(out.keys_to_store, leg, True)
    producer.on_request_finished(leg)
    assert set(producer_link.failed.values()) <= {StoreFailure.OUT_OF_WINDOW}

    consumer_pool = HostPagePool(BytearrayPageBuffer(64, NBYTES))
    consumer_link = Link(consumer_pool, peer=producer_link)
    consumer = TieringManager(consumer_pool, [consumer_link])
    decode = ReqContext(RequestId("decode"))
    consumer.on_new_request(decode)

    first = scan_request(req, lambda k: consumer.lookup(k, decode), layout)
    assert not first.ready  # promotions under way: scan again later
    assert first.hit_chunks == load_scan_end(num_tokens, layout)
    assert set(consumer_link.demanded) <= set(producer_link.supply)
    consumer_link.deliver()
    second = scan_request(req, lambda k: consumer.lookup(k, decode), layout)
    assert second.ready and second.wait_keys == ()
    assert second.hit_chunks == first.hit_chunks

    keys = [k for group_keys in second.load_keys for k in group_keys]
    spec = consumer.prepare_load(keys, decode)
    for k, page in zip(keys, spec.page_indices, strict=True):
        assert bytes(consumer_pool.buffer.page_view(page)) == k[:16] * 2
    consumer.complete_load(keys, decode)
    consumer.on_request_finished(decode)
    assert consumer_pool.stats().referenced == 0

    producer_link.release()
    assert producer_pool.stats().referenced == 0
    producer.close()
    consumer.close()
