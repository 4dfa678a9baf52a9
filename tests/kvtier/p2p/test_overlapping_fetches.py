"""Concurrent fetches into one consumer pool whose demands overlap: a key one fetch installs
meanwhile is held for the other too, not a refused page (the prefix must not end there)."""

from __future__ import annotations

import asyncio

from kvtier.keys import OffloadKey

from .conftest import Pair, make_keys, make_pair, payload, producer_ctx, rid, wait_until, write_page


def supply_shared(pair: Pair, k: str, keys: list[OffloadKey]) -> None:
    """Offer ``keys`` (already readable in the producer's pool) under ``k``."""
    ctx = producer_ctx(k, name=f"req-{k}")
    pair.tier.on_new_request(ctx)
    pair.tier.submit_store(keys, ctx)
    pair.tier.on_request_finished(ctx)


async def test_overlapping_concurrent_fetches_both_get_the_full_prefix(pair: Pair) -> None:
    keys = make_keys(10, start=7000)
    for key in keys:
        write_page(pair.producer_pool, key)
    baseline = {key: pair.producer_pool.refcount(key) for key in keys}
    first, second = rid(301), rid(302)
    supply_shared(pair, first, keys[:8])
    supply_shared(pair, second, keys[2:])
    # Both fetches decide what they lack before either installs anything: both demand keys[2:8].
    a, b = await asyncio.gather(pair.fetch(first, keys[:8]), pair.fetch(second, keys[2:]))
    assert a.complete and a.reason is None and a.usable == 8
    assert b.complete and b.reason is None and b.usable == 8
    installed = set(a.fetched) | set(b.fetched)
    assert installed == set(keys)  # every key was installed by exactly one of them
    assert not set(a.fetched) & set(b.fetched)
    assert set(a.found_meanwhile) | set(b.found_meanwhile) == set(keys[2:8])
    for key in keys:
        with pair.consumer_pool.acquire(key) as ref:
            assert bytes(ref.view) == payload(key)
    stats = pair.consumer_pool.stats()
    assert stats.readable == len(keys) and stats.refusals == 0 and stats.write_failures == 0
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()
    assert {key: pair.producer_pool.refcount(key) for key in keys} == baseline
    assert all(pair.consumer_pool.refcount(key) == 0 for key in keys)


async def test_a_key_readable_before_the_block_arrives_is_skipped_not_refused() -> None:
    """The key turns readable locally after the fetch decided to demand it (e.g. a local store)."""
    pair = await make_pair(consumer_pages=4)
    try:
        keys = make_keys(3, start=9000)
        for key in keys:
            write_page(pair.producer_pool, key)
        k = rid(303)
        supply_shared(pair, k, keys)
        fetch = asyncio.create_task(pair.fetch(k, keys))
        await asyncio.sleep(0)  # the fetch has decided what it lacks: all three keys
        write_page(pair.consumer_pool, keys[1])
        result = await fetch
        assert result.complete and result.usable == 3
        assert keys[1] not in result.fetched
        for key in keys:
            with pair.consumer_pool.acquire(key) as ref:
                assert bytes(ref.view) == payload(key)
        await wait_until(lambda: pair.registry.stats().requests == 0)
        pair.assert_baseline()
    finally:
        await pair.client.close()
        await pair.server.stop()
