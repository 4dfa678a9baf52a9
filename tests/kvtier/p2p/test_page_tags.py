"""Page tags are computed once per page write: a page supplied again reuses its tag, a page
rewritten (evicted, then written with other bytes into the same slot) is tagged afresh."""

from __future__ import annotations

import asyncio

from kvtier.keys import OffloadKey
from kvtier.offload.pool import HostPagePool
from kvtier.p2p import P2PTier, SupplyRegistry
from kvtier.p2p.sealing import PageTag
from kvtier.p2p.supply import SendHold

from .conftest import FINGERPRINT, PAGE, Pair, make_keys, new_pool, producer_ctx, rid, wait_until


async def held_tag(registry: SupplyRegistry, kv_request_id: str, key: OffloadKey) -> PageTag:
    loop = asyncio.get_running_loop()
    hold = await registry.acquire(kv_request_id, key, loop.time() + 1, loop.time() + 1)  # type: ignore[arg-type]
    assert isinstance(hold, SendHold), hold
    try:
        assert hold.tag is not None
        return hold.tag
    finally:
        hold.close()


def supply_leg(tier: P2PTier, kv_request_id: str, keys: list[OffloadKey], name: str) -> None:
    ctx = producer_ctx(kv_request_id, name)
    tier.on_new_request(ctx)
    tier.submit_store(keys, ctx)
    tier.on_request_finished(ctx)


def write(pool: HostPagePool, key: OffloadKey, fill: int) -> None:
    pool.allocate(key)
    pool.write_view(key)[:PAGE] = bytes([fill]) * PAGE
    pool.complete_write(key, True)


async def test_a_page_supplied_again_reuses_its_tag(pair: Pair) -> None:
    keys = make_keys(4)
    for i, key in enumerate(keys):
        write(pair.producer_pool, key, i)
    tags = []
    for leg in range(2):  # the second leg is a warm producer: same pages, already written
        supply_leg(pair.tier, rid(leg), keys, f"req-{leg}")
        tags.append([await held_tag(pair.registry, rid(leg), key) for key in keys])
        result = await pair.fetch(rid(leg), keys)
        assert result.complete, result
    assert tags[0] == tags[1]
    assert len({tag.nonce for tag in tags[0]}) == len(keys)
    assert pair.tier.cached_tags == len(keys)
    await wait_until(lambda: pair.registry.stats().requests == 0)  # done reached the producer
    pair.assert_baseline()


async def test_a_rewritten_page_is_tagged_afresh(pair: Pair) -> None:
    """One-page pool: the key is evicted and written again, with other bytes, into the same
    slot; the new supply carries a new tag and the consumer installs the new bytes."""
    pool = new_pool(1)
    tier = P2PTier(pool, pair.registry, FINGERPRINT)
    key, other = make_keys(2)
    write(pool, key, 0xAA)
    supply_leg(tier, rid(1), [key], "req-1")
    first = await held_tag(pair.registry, rid(1), key)
    pair.registry.release(rid(1), "test")
    write(pool, other, 0x00)  # evicts key
    write(pool, key, 0xBB)  # evicts other; key is back in slot 0 with other bytes
    assert pool.page_index(key) == 0
    supply_leg(tier, rid(2), [key], "req-2")
    second = await held_tag(pair.registry, rid(2), key)
    assert second != first
    result = await pair.fetch(rid(2), [key])
    assert result.complete, result
    with pair.consumer_pool.acquire(key) as ref:
        assert bytes(ref.view[:PAGE]) == b"\xbb" * PAGE
    assert tier.cached_tags == 1  # bounded by the pool's pages
    tier.close()
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()
