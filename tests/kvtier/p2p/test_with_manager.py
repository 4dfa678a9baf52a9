"""The P2P tier inside an unmodified TieringManager: supply covers demand in every shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvtier.keys import OffloadKey
from kvtier.offload import LookupResult, TieringManager
from kvtier.offload.types import ReqContext, RequestId, StoreFailure

from .conftest import Pair, make_keys, make_pair, payload, producer_ctx, rid, wait_until


@pytest.fixture
async def wired() -> AsyncIterator[tuple[Pair, TieringManager, TieringManager]]:
    pair = await make_pair()
    producer = TieringManager(pair.producer_pool, [pair.tier])
    consumer = TieringManager(pair.consumer_pool)
    try:
        yield pair, producer, consumer
    finally:
        producer.close()
        consumer.close()
        await pair.client.close()
        await pair.server.stop()


def engine_copy(manager: TieringManager, keys: tuple[OffloadKey, ...], ctx: ReqContext) -> None:
    """What the engine does with ``keys_to_store``: fill the host pages, then complete."""
    for key in keys:
        manager.pool.write_view(key)[:] = payload(key)
    manager.complete_store(keys, ctx, True)


def plain_request(manager: TieringManager, name: str, keys: list[OffloadKey]) -> ReqContext:
    ctx = ReqContext(RequestId(name))
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    engine_copy(manager, out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return ctx


async def settle(pair: Pair) -> None:
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()


def assert_loadable(consumer: TieringManager, keys: list[OffloadKey], usable: int) -> None:
    ctx = ReqContext(RequestId("decode"))
    consumer.on_new_request(ctx)
    assert all(consumer.lookup(k, ctx) is LookupResult.HIT for k in keys[:usable])
    consumer.prepare_load(keys[:usable], ctx)
    for key in keys[:usable]:
        with consumer.pool.acquire(key) as ref:
            assert bytes(ref.view) == payload(key)
    consumer.complete_load(keys[:usable], ctx)
    consumer.on_request_finished(ctx)


async def test_cold(wired: tuple[Pair, TieringManager, TieringManager]) -> None:
    pair, producer, consumer = wired
    k, keys = rid(1), make_keys(8)
    ctx = producer_ctx(k)
    producer.on_new_request(ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys))
    for i in range(0, 8, 2):  # chunked prefill: two keys per step
        await asyncio.sleep(0.01)
        out = producer.prepare_store(keys[i : i + 2], ctx)
        assert out.keys_to_store == tuple(keys[i : i + 2])
        engine_copy(producer, out.keys_to_store, ctx)
    producer.on_request_finished(ctx)
    result = await fetch
    assert result.complete
    assert_loadable(consumer, keys, 8)
    await settle(pair)


async def test_warm_the_original_bug(wired: tuple[Pair, TieringManager, TieringManager]) -> None:
    """Everything already in the primary tier: no GPU copy, yet the supply is complete."""
    pair, producer, consumer = wired
    keys = make_keys(16)
    plain_request(producer, "earlier", keys)
    k = rid(2)
    ctx = producer_ctx(k)
    producer.on_new_request(ctx)
    out = producer.prepare_store(keys, ctx)
    assert out.keys_to_store == ()
    producer.on_request_finished(ctx)
    assert sorted(pair.registry.keys_of(k)) == sorted(keys)
    result = await pair.fetch(k, keys)
    assert result.complete and len(result.fetched) == 16
    assert_loadable(consumer, keys, 16)
    await settle(pair)


async def test_mixed_with_store_in_flight(
    wired: tuple[Pair, TieringManager, TieringManager],
) -> None:
    """Warm keys cascade, another request's in-flight store is parked (vLLM #53062), the rest is
    copied; demand arriving meanwhile is served as each becomes readable."""
    pair, producer, consumer = wired
    keys = make_keys(12)
    plain_request(producer, "earlier", keys[:4])
    other = ReqContext(RequestId("other"))
    producer.on_new_request(other)
    inflight = producer.prepare_store(keys[4:8], other)
    assert inflight.keys_to_store == tuple(keys[4:8])
    k = rid(3)
    ctx = producer_ctx(k)
    producer.on_new_request(ctx)
    out = producer.prepare_store(keys, ctx)
    assert out.keys_to_store == tuple(keys[8:])  # only the cold part is copied
    fetch = asyncio.create_task(pair.fetch(k, keys))
    await wait_until(lambda: pair.consumer_pool.stats().readable == 4)
    engine_copy(producer, out.keys_to_store, ctx)
    producer.on_request_finished(ctx)  # finished, but still waiting on the parked writes
    await asyncio.sleep(0.05)
    assert not fetch.done()
    engine_copy(producer, inflight.keys_to_store, other)
    producer.on_request_finished(other)
    result = await fetch
    assert result.complete
    assert_loadable(consumer, keys, 12)
    await settle(pair)


async def test_failed_write_fails_demand_fast(
    wired: tuple[Pair, TieringManager, TieringManager],
) -> None:
    pair, producer, _ = wired
    keys = make_keys(6)
    k = rid(4)
    ctx = producer_ctx(k)
    producer.on_new_request(ctx)
    out = producer.prepare_store(keys, ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys, timeout=30.0))
    engine_copy(producer, out.keys_to_store[:3], ctx)
    producer.complete_store(out.keys_to_store[3:], ctx, False)
    producer.on_request_finished(ctx)
    result = await fetch
    assert result.usable == 3 and StoreFailure.WRITE_FAILED.value in (result.reason or "")
    assert result.elapsed_s < 0.5
    await settle(pair)


async def test_consumer_with_local_prefix(
    wired: tuple[Pair, TieringManager, TieringManager],
) -> None:
    pair, producer, consumer = wired
    keys = make_keys(10)
    plain_request(producer, "earlier", keys)
    k = rid(5)
    ctx = producer_ctx(k)
    producer.on_new_request(ctx)
    producer.prepare_store(keys, ctx)
    producer.on_request_finished(ctx)
    plain_request(consumer, "decode-earlier", keys[:6])
    result = await pair.fetch(k, keys)
    assert result.complete and result.local == 6 and result.fetched == tuple(keys[6:])
    assert_loadable(consumer, keys, 10)
    await settle(pair)


async def test_plain_and_consumer_legs_supply_nothing(
    wired: tuple[Pair, TieringManager, TieringManager],
) -> None:
    pair, producer, _ = wired
    keys = make_keys(4)
    plain_request(producer, "plain", keys)
    ctx = ReqContext(
        RequestId("decode-leg"),
        kv_transfer_params={
            "remote_prefiller": {"kv_request_id": "k", "remote_host": "h", "remote_port": 1}
        },
    )
    producer.on_new_request(ctx)
    producer.prepare_store(keys, ctx)
    producer.on_request_finished(ctx)
    assert pair.registry.stats().requests == 0
    assert producer.stats().write_through == 0  # the P2P tier declines write-through
    pair.assert_baseline()
