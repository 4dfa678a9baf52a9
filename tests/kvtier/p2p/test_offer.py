"""Symmetric pull (``offer`` / ``offered``): a holder pins the leading run of offered keys it
holds into a short-lived supply; the puller fetches it and says done. Scenarios over loopback
with real pools and sockets (hostile pullers: ``test_offer_attacker``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import settings as settings_h
from hypothesis import strategies as st

from kvtier.offload.pool import HostPagePool
from kvtier.p2p import P2PClient, P2PTier, PoolHoldings, SupplyRegistry
from kvtier.p2p.frames import Offer
from kvtier.p2p.offer import OfferDesk, OfferLedger

from .conftest import FINGERPRINT, make_keys, new_pool, payload, raw_session, settings, wait_until
from .offer_peers import (
    Holder,
    deadline,
    held_bytes,
    make_holder,
    make_puller,
    offer_on,
    warm,
)


@pytest.mark.parametrize("held", [0, 3, 8])
async def test_pull_fetches_the_leading_run_the_holder_has(
    holder: Holder, puller: tuple[P2PClient, HostPagePool], held: int
) -> None:
    client, pool = puller
    keys = make_keys(8)
    warm(holder.pool, keys[:held])
    result = await client.pull("127.0.0.1", holder.port, keys, deadline=deadline())
    assert result.usable == held and list(result.fetched) == keys[:held]
    assert result.nbytes == held * FINGERPRINT.page_nbytes(keys[0])
    assert (result.reason is None) == (held == 8)
    assert result.holder_short == (held < 8)  # lacking the tail: short, not a failure
    for key in keys[:held]:
        assert held_bytes(pool, key) == payload(key)
    await wait_until(lambda: holder.registry.stats().requests == 0)  # done released it
    holder.assert_baseline()
    assert pool.stats().referenced == 0


async def test_offer_answers_only_the_contiguous_leading_run(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, _ = puller
    keys = make_keys(6)
    warm(holder.pool, [keys[0], keys[1], keys[3], keys[4]])  # a hole at 2
    offered = await client.offer("127.0.0.1", holder.port, keys, deadline=deadline())
    assert offered.num_held == 2 and offered.kv_request_id is not None
    assert "2 of the 6" in (offered.reason or "") and offered.holder_short
    assert holder.registry.keys_of(offered.kv_request_id) == keys[:2]
    assert holder.pool.stats().referenced == 2  # only the run is pinned
    await client.release("127.0.0.1", holder.port, offered.kv_request_id)
    await wait_until(lambda: holder.registry.stats().requests == 0)
    holder.assert_baseline()


async def test_nothing_held_opens_no_supply(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, _ = puller
    offered = await client.offer("127.0.0.1", holder.port, make_keys(4), deadline=deadline())
    assert (offered.kv_request_id, offered.num_held) == (None, 0)
    assert holder.registry.stats().requests == 0
    assert holder.server.offers is not None and holder.server.offers.stats().offers_total == 1


async def test_pull_offers_only_what_the_puller_lacks(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, pool = puller
    keys = make_keys(6)
    warm(holder.pool, keys)
    warm(pool, keys[:2])  # the puller already has the first two
    result = await client.pull("127.0.0.1", holder.port, keys, deadline=deadline())
    assert result.complete and result.local == 2 and list(result.fetched) == keys[2:]
    assert holder.server.offers is not None
    assert holder.server.offers.stats().offered_keys_total == 4


async def test_keys_evicted_between_offer_and_fetch_are_still_served(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    """The offer pinned them: the holder's pool cannot evict them before the fetch."""
    client, _ = puller
    keys = make_keys(4)
    warm(holder.pool, keys)
    offered = await client.offer("127.0.0.1", holder.port, keys, deadline=deadline())
    assert offered.kv_request_id is not None and offered.num_held == 4
    # Write a pool's worth of other pages: the pool evicts all it can, never the offer's.
    warm(holder.pool, make_keys(holder.pool.num_pages, start=10_000))
    assert holder.pool.stats().evictions >= 4
    assert all(holder.pool.lookup(k).name == "HIT" for k in keys)
    result = await client.fetch("127.0.0.1", holder.port, offered.kv_request_id, keys, deadline())
    assert result.complete
    await wait_until(lambda: holder.registry.stats().requests == 0)
    holder.assert_baseline()


async def test_keys_gone_before_the_offer_end_the_run(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, _ = puller
    keys = make_keys(4)
    warm(holder.pool, keys)
    warm(holder.pool, make_keys(holder.pool.num_pages - 2, start=10_000))  # evicts keys[0:2]
    result = await client.pull("127.0.0.1", holder.port, keys, deadline=deadline())
    assert result.usable == 0 and result.reason is not None


async def test_lease_expiry_releases_an_unfetched_offer() -> None:
    h = await make_holder(settings(offer_lease_s=0.3, lease_s=60.0))
    client, _ = make_puller()
    try:
        keys = make_keys(5)
        warm(h.pool, keys)
        offered = await client.offer("127.0.0.1", h.port, keys, deadline=deadline())
        assert offered.num_held == 5 and h.pool.stats().referenced == 5
        await wait_until(lambda: h.registry.stats().requests == 0, timeout=5.0)
        h.assert_baseline()
        assert offered.kv_request_id is not None
        late = await client.fetch("127.0.0.1", h.port, offered.kv_request_id, keys, deadline())
        assert late.usable == 0 and "released" in (late.reason or "")
    finally:
        await client.close()
        await h.server.stop()


async def test_done_releases_at_once(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, _ = puller
    keys = make_keys(3)
    warm(holder.pool, keys)
    offered = await client.offer("127.0.0.1", holder.port, keys, deadline=deadline())
    assert offered.kv_request_id is not None
    result = await client.fetch("127.0.0.1", holder.port, offered.kv_request_id, keys, deadline())
    assert result.complete
    await wait_until(lambda: holder.registry.stats().requests == 0, timeout=1.0)
    holder.assert_baseline()


async def test_holder_gone_returns_a_reason_within_the_deadline() -> None:
    h = await make_holder(settings())
    port = h.port
    await h.server.stop()
    client, _ = make_puller()
    try:
        started = time.monotonic()
        result = await client.pull("127.0.0.1", port, make_keys(3), deadline=deadline(3.0))
        assert result.usable == 0 and result.reason is not None
        assert not result.holder_short  # a transport failure
        assert time.monotonic() - started < 3.5
    finally:
        await client.close()


async def test_session_reused_for_offer_and_fetch(
    holder: Holder, puller: tuple[P2PClient, HostPagePool]
) -> None:
    client, _ = puller
    for start in (0, 100, 200):
        keys = make_keys(3, start=start)
        warm(holder.pool, keys)
        assert (await client.pull("127.0.0.1", holder.port, keys, deadline=deadline())).complete
    assert client.sessions_opened == 1


async def test_an_offer_supply_outlives_its_session_and_is_fetched_on_another(
    holder: Holder,
) -> None:
    """vLLM's scheduler offers on one connection and its worker fetches on another: the
    supply must survive the first connection's end, and done on the second releases it."""
    keys = make_keys(3)
    warm(holder.pool, keys)
    asker = await raw_session(holder.port)
    answer = await offer_on(asker, keys)
    asker.close()
    assert answer.kv_request_id is not None and answer.num_held == 3
    await asyncio.sleep(0.2)  # the holder has seen the close
    assert holder.registry.is_open(answer.kv_request_id)
    client, _ = make_puller()
    try:
        result = await client.fetch(
            "127.0.0.1", holder.port, answer.kv_request_id, keys, deadline()
        )
        assert result.complete
    finally:
        await client.close()
    await wait_until(lambda: holder.registry.stats().requests == 0)
    holder.assert_baseline()


@settings_h(max_examples=60, deadline=None)
@given(
    held=st.lists(st.booleans(), min_size=0, max_size=12),
    order=st.permutations(list(range(12))),
)
def test_offered_is_the_leading_run_and_release_restores_the_pool(
    held: list[bool], order: list[int]
) -> None:
    """Invariant: ``num_held`` is the length of the leading run of offered keys the pool holds
    readable, exactly those pages are pinned, and releasing the supply unpins them all."""

    async def run() -> None:
        s = settings()
        pool = new_pool()
        registry = SupplyRegistry(s.lease_s)
        desk = OfferDesk(s, registry, PoolHoldings(P2PTier(pool, registry, FINGERPRINT)))
        keys = make_keys(12)
        offered = [keys[i] for i in order][: len(held)]
        warm(pool, [k for k, h in zip(offered, held, strict=True) if h])
        answer = await desk.answer(Offer(tuple(offered)), OfferLedger())
        run_length = next((i for i, h in enumerate(held) if not h), len(held))
        assert answer.num_held == run_length
        assert (answer.kv_request_id is None) == (run_length == 0)
        assert pool.stats().referenced == run_length
        if answer.kv_request_id is not None:
            assert registry.keys_of(answer.kv_request_id) == offered[:run_length]
            registry.release(answer.kv_request_id, "test")
        assert pool.stats().referenced == 0 and registry.stats().requests == 0

    asyncio.run(run())
