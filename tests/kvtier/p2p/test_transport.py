"""Producer and consumer over loopback: the tier driven as the tiering manager drives it."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.errors import HandshakeRefused
from kvtier.offload.types import OffloadPolicy, ReqContext, RequestId, StoreFailure
from kvtier.p2p.client import FetchResult

from .conftest import (
    Pair,
    begin_write,
    make_keys,
    make_pair,
    payload,
    producer_ctx,
    raw_session,
    rid,
    settings,
    wait_until,
    write_page,
)


def assert_installed(pair: Pair, result: FetchResult) -> None:
    for key in result.keys[: result.usable]:
        with pair.consumer_pool.acquire(key) as ref:
            assert bytes(ref.view) == payload(key)


async def settle(pair: Pair) -> None:
    """Wait for the producer to process ``done`` and drop the supply."""
    await wait_until(lambda: pair.registry.stats().requests == 0)
    pair.assert_baseline()


def test_policy_is_request_level_only_for_producer_legs(pair: Pair) -> None:
    tier = pair.tier
    assert tier.on_new_request(producer_ctx("k1")).policy is OffloadPolicy.REQUEST_LEVEL
    cases: list[dict[str, object] | None] = [
        None,
        {},
        {"remote_decoder": {}},
        {"remote_decoder": {"kv_request_id": ""}},
        {"remote_decoder": {"kv_request_id": 5}},
        {"remote_prefiller": {"kv_request_id": "k", "remote_host": "h", "remote_port": 1}},
        {"do_remote_decode": True},
    ]
    for params in cases:
        ctx = ReqContext(RequestId("r"), kv_transfer_params=params)
        assert tier.on_new_request(ctx).policy is OffloadPolicy.BLOCK_LEVEL, params
        assert tier.name not in ctx.tier_state
    assert pair.registry.is_open(rid(0)) is False
    assert pair.registry.is_open("k1")  # type: ignore[arg-type]


async def test_cold_producer_serves_blocks_as_they_become_readable(pair: Pair) -> None:
    k, keys = rid(1), make_keys(8)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys))
    for key in keys:
        await asyncio.sleep(0.005)
        write_page(pair.producer_pool, key)
        pair.tier.submit_store([key], ctx)
    pair.tier.on_request_finished(ctx)
    result = await fetch
    assert result.complete and result.reason is None
    assert result.fetched == tuple(keys) and result.local == 0
    assert result.nbytes == 8 * pair.producer_pool.page_nbytes
    assert_installed(pair, result)
    await settle(pair)


async def test_warm_producer_supply_is_complete(pair: Pair) -> None:
    """Everything already in the primary tier: cascaded keys are the whole supply."""
    k, keys = rid(2), make_keys(16)
    for key in keys:
        write_page(pair.producer_pool, key)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    pair.tier.submit_store(keys, ctx)  # the cascade: no GPU copy, every key
    pair.tier.on_request_finished(ctx)
    assert sorted(pair.registry.keys_of(k)) == sorted(keys)
    assert all(pair.producer_pool.refcount(key) == 1 for key in keys)
    result = await pair.fetch(k, keys)
    assert result.complete and result.fetched == tuple(keys)
    assert_installed(pair, result)
    await settle(pair)


async def test_mixed_and_store_in_flight_at_fetch_time(pair: Pair) -> None:
    k, keys = rid(3), make_keys(12)
    warm, inflight, cold = keys[:4], keys[4:8], keys[8:]
    for key in warm:
        write_page(pair.producer_pool, key)
    for key in inflight:  # another request's store is in flight: HIT_PENDING
        begin_write(pair.producer_pool, key)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    pair.tier.submit_store(warm, ctx)
    pair.tier.on_store_pending(inflight, ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys))
    await asyncio.sleep(0.05)
    for key in cold:
        write_page(pair.producer_pool, key)
        pair.tier.submit_store([key], ctx)
    await asyncio.sleep(0.05)
    assert not fetch.done()  # waits for the parked keys, which come first in order
    for key in inflight:  # the other request's writes complete; the manager cascades them
        pair.producer_pool.complete_write(key, True)
        pair.tier.submit_store([key], ctx)
    pair.tier.on_request_finished(ctx)
    result = await fetch
    assert result.complete
    assert_installed(pair, result)
    await settle(pair)


async def test_parked_key_waits_even_after_the_producer_finished(pair: Pair) -> None:
    k, keys = rid(4), make_keys(3)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys:
        begin_write(pair.producer_pool, key)
    pair.tier.on_store_pending(keys, ctx)
    pair.tier.on_request_finished(ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys))
    await asyncio.sleep(0.05)
    for key in keys:
        pair.producer_pool.complete_write(key, True)
        pair.tier.submit_store([key], ctx)
    result = await fetch
    assert result.complete
    await settle(pair)


async def test_consumer_fetches_only_what_it_lacks(pair: Pair) -> None:
    k, keys = rid(5), make_keys(10)
    for key in keys:
        write_page(pair.producer_pool, key)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    pair.tier.submit_store(keys, ctx)
    pair.tier.on_request_finished(ctx)
    for key in keys[:4]:
        write_page(pair.consumer_pool, key)
    write_page(pair.consumer_pool, keys[7])  # a local hit after the gap is not fetched either
    result = await pair.fetch(k, keys)
    assert result.complete and result.local == 5
    assert result.fetched == (*keys[4:7], *keys[8:])
    assert result.nbytes == 5 * pair.consumer_pool.page_nbytes
    assert_installed(pair, result)
    await settle(pair)


async def test_everything_local_fetches_nothing_but_releases_supply(pair: Pair) -> None:
    k, keys = rid(6), make_keys(4)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys:
        write_page(pair.producer_pool, key)
        write_page(pair.consumer_pool, key)
    pair.tier.submit_store(keys, ctx)
    pair.tier.on_request_finished(ctx)
    result = await pair.fetch(k, keys)
    assert result.complete and result.fetched == () and result.local == 4
    await settle(pair)


async def test_sessions_are_reused_per_producer(pair: Pair) -> None:
    for n in range(3):
        k, keys = rid(100 + n), make_keys(2, start=1000 * n)
        ctx = producer_ctx(k)
        pair.tier.on_new_request(ctx)
        for key in keys:
            write_page(pair.producer_pool, key)
        pair.tier.submit_store(keys, ctx)
        pair.tier.on_request_finished(ctx)
        assert (await pair.fetch(k, keys)).complete
    assert pair.client.sessions_opened == 1
    await settle(pair)


async def test_concurrent_fetches_use_separate_sessions(pair: Pair) -> None:
    ks = [rid(200 + n) for n in range(3)]
    all_keys = [make_keys(4, start=5000 * (n + 1)) for n in range(3)]
    for k, keys in zip(ks, all_keys, strict=True):
        ctx = producer_ctx(k)
        pair.tier.on_new_request(ctx)
        for key in keys:
            write_page(pair.producer_pool, key)
        pair.tier.submit_store(keys, ctx)
        pair.tier.on_request_finished(ctx)
    results = await asyncio.gather(
        *(pair.fetch(k, ks_) for k, ks_ in zip(ks, all_keys, strict=True))
    )
    assert all(r.complete for r in results)
    await settle(pair)


# ---- fast failure -----------------------------------------------------------------------------


async def test_finished_producer_fails_missing_demand_at_once(pair: Pair) -> None:
    k, keys = rid(7), make_keys(10)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    for key in keys[:6]:
        write_page(pair.producer_pool, key)
    pair.tier.submit_store(keys[:6], ctx)
    pair.tier.on_request_finished(ctx)
    t0 = time.monotonic()
    result = await pair.fetch(k, keys, timeout=30.0)
    elapsed = time.monotonic() - t0
    assert result.usable == 6 and result.fetched == tuple(keys[:6])
    assert result.reason is not None and "not in supply" in result.reason
    assert elapsed < 0.5, f"fast failure took {elapsed:.3f} s"
    assert_installed(pair, result)
    await settle(pair)


async def test_running_producer_failure_is_signalled_at_once(pair: Pair) -> None:
    k, keys = rid(8), make_keys(4)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    write_page(pair.producer_pool, keys[0])
    pair.tier.submit_store(keys[:1], ctx)
    pair.tier.on_store_failed(keys[1:2], ctx, StoreFailure.POOL_EXHAUSTED)
    t0 = time.monotonic()
    result = await pair.fetch(k, keys, timeout=30.0)  # the producer is still running
    assert time.monotonic() - t0 < 0.5
    assert result.usable == 1 and result.reason is not None and "pool_exhausted" in result.reason
    pair.tier.on_request_finished(ctx)
    await settle(pair)


async def test_finish_wakes_waiting_demand(pair: Pair) -> None:
    k, keys = rid(9), make_keys(3)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    fetch = asyncio.create_task(pair.fetch(k, keys, timeout=30.0))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    pair.tier.on_request_finished(ctx)  # nothing was supplied
    result = await fetch
    assert time.monotonic() - t0 < 0.5
    assert result.usable == 0 and result.reason is not None
    await settle(pair)


async def test_unknown_and_released_ids_fail_fast(pair: Pair) -> None:
    keys = make_keys(2)
    t0 = time.monotonic()
    result = await pair.fetch("no-such-request", keys, timeout=30.0)
    assert result.usable == 0 and "unknown" in (result.reason or "")
    assert time.monotonic() - t0 < 1.0  # the unknown-id grace is 0.2 s here
    k = rid(10)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    pair.registry.release(k, "test")
    t0 = time.monotonic()
    result = await pair.fetch(k, keys, timeout=30.0)
    assert time.monotonic() - t0 < 0.15
    assert "released" in (result.reason or "")
    pair.assert_baseline()


async def test_consumer_deadline_holds_while_producer_still_runs(pair: Pair) -> None:
    k, keys = rid(11), make_keys(3)
    ctx = producer_ctx(k)
    pair.tier.on_new_request(ctx)
    write_page(pair.producer_pool, keys[0])
    pair.tier.submit_store(keys[:1], ctx)
    t0 = time.monotonic()
    result = await pair.fetch(k, keys, timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.2 < elapsed < 1.0
    assert result.usable == 1 and result.reason is not None
    pair.tier.on_request_finished(ctx)
    pair.registry.release(k, "test")
    await wait_until(lambda: pair.registry.stats().sending == 0)
    pair.assert_baseline()


async def test_long_demand_is_split_and_duplicates_fetched_once() -> None:
    pair = await make_pair(client_settings=settings(max_keys_per_fetch=3))
    try:
        k, keys = rid(12), make_keys(8)
        ctx = producer_ctx(k)
        pair.tier.on_new_request(ctx)
        for key in keys:
            write_page(pair.producer_pool, key)
        pair.tier.submit_store(keys, ctx)
        pair.tier.on_request_finished(ctx)
        result = await pair.fetch(k, [*keys, keys[2]])
        assert result.complete and result.fetched == tuple(keys)
        assert_installed(pair, result)
        await settle(pair)
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_malformed_keys_are_a_caller_error(pair: Pair) -> None:
    with pytest.raises(ValueError, match="18 bytes"):
        await pair.fetch(rid(13), [b"short"])  # type: ignore[list-item]


async def test_key_of_a_group_the_layout_lacks_closes_the_connection(pair: Pair) -> None:
    from kvtier.p2p.frames import Fetch

    channel = await raw_session(pair.port)
    try:
        await channel.send_frame(Fetch(rid(14), tuple(make_keys(1, group=5)), 1000))
        assert await channel.read_frame() is None
    finally:
        channel.close()
    assert pair.server.protocol_errors_total == 1


async def test_connection_limit_counts_authenticated_sessions() -> None:
    pair = await make_pair(settings(max_connections=1))
    try:
        first = await raw_session(pair.port)
        try:
            with pytest.raises(HandshakeRefused, match="server busy: 1 sessions open"):
                await raw_session(pair.port)
            assert pair.server.stats().busy_total == 1
        finally:
            first.close()
        await wait_until(lambda: pair.server.stats().sessions == 0)
        second = await raw_session(pair.port)  # the slot is free again
        second.close()
    finally:
        await pair.client.close()
        await pair.server.stop()


async def test_session_closed_by_an_idle_producer_is_replaced() -> None:
    pair = await make_pair(settings(idle_session_s=0.3), settings(idle_session_s=60))
    try:
        for n in range(2):
            k, keys = rid(300 + n), make_keys(2, start=9000 + 100 * n)
            ctx = producer_ctx(k)
            pair.tier.on_new_request(ctx)
            for key in keys:
                write_page(pair.producer_pool, key)
            pair.tier.submit_store(keys, ctx)
            pair.tier.on_request_finished(ctx)
            assert (await pair.fetch(k, keys)).complete
            await wait_until(lambda: pair.server.active_connections == 0, timeout=3.0)
        assert pair.client.sessions_opened == 2
        await settle(pair)
    finally:
        await pair.client.close()
        await pair.server.stop()
