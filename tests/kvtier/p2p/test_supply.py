"""The supply registry on its own: ownership of page references, waits, leases, threads."""

from __future__ import annotations

import asyncio
import threading

from kvtier.p2p.frames import KvRequestId
from kvtier.p2p.supply import SendHold, SupplyRegistry

from .conftest import make_keys

K = KvRequestId("k")


class CountedPage:
    """A SupplyPage that records its release (must happen exactly once)."""

    def __init__(self, data: bytes = b"payload") -> None:
        self.data = data
        self.releases = 0

    def view(self) -> memoryview:
        return memoryview(self.data)

    def release(self) -> None:
        self.releases += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pages_are_released_exactly_once_on_every_path() -> None:
    clock = Clock()
    registry = SupplyRegistry(10.0, clock=clock)
    keys = make_keys(3)
    orphan = CountedPage()
    assert not registry.supply(K, keys[0], orphan)  # K not open: released at once
    assert orphan.releases == 1
    registry.open(K)
    first, duplicate = CountedPage(), CountedPage()
    assert registry.supply(K, keys[0], first)
    assert not registry.supply(K, keys[0], duplicate)
    assert duplicate.releases == 1 and first.releases == 0
    registry.fail(K, keys[0], "late failure")  # a readable key stays readable
    assert registry.keys_of(K) == [keys[0]]
    registry.finish(K)
    clock.now += 9.9
    assert registry.expire() == []
    clock.now += 0.2
    assert registry.expire() == [K]
    assert first.releases == 1
    late = CountedPage()
    assert not registry.supply(K, keys[1], late)
    assert late.releases == 1
    assert not registry.release(K, "again")


async def test_supply_from_another_thread_wakes_demand() -> None:
    registry = SupplyRegistry(10.0)
    key = make_keys(1)[0]
    registry.open(K)
    loop = asyncio.get_running_loop()
    page = CountedPage(b"x" * 64)
    timer = threading.Timer(0.05, registry.supply, args=(K, key, page))
    timer.start()
    try:
        t0 = loop.time()
        hold = await registry.acquire(K, key, t0 + 5, t0)
        assert isinstance(hold, SendHold)
        assert loop.time() - t0 < 1.0
        assert bytes(hold.view) == b"x" * 64
        registry.release(K, "done")
        assert page.releases == 0  # still being sent
        hold.close()
        assert page.releases == 1
    finally:
        timer.join()


async def test_demand_for_an_id_registered_during_the_grace() -> None:
    registry = SupplyRegistry(10.0)
    key = make_keys(1)[0]
    loop = asyncio.get_running_loop()
    waiter = asyncio.create_task(registry.acquire(K, key, loop.time() + 5, loop.time() + 1))
    await asyncio.sleep(0.02)
    registry.open(K)
    page = CountedPage()
    registry.supply(K, key, page)
    hold = await waiter
    assert isinstance(hold, SendHold)
    hold.close()
    registry.close()
    assert page.releases == 1
    assert registry.stats().requests == 0
    t0 = loop.time()
    assert (
        await registry.acquire(K, key, t0 + 5, t0 + 5) == "supply released (producer shutting down)"
    )
    assert page.releases == 1


def test_release_that_races_ahead_of_open_holds_nothing() -> None:
    """The proxy's release (client gone) may reach the producer before its leg opens K."""
    registry = SupplyRegistry(10.0, clock=Clock())
    keys = make_keys(2)
    assert registry.release(K, "client gone") is False
    registry.open(K)
    assert not registry.is_open(K)
    pages = [CountedPage(), CountedPage()]
    assert not any(registry.supply(K, key, page) for key, page in zip(keys, pages, strict=True))
    assert [p.releases for p in pages] == [1, 1]
    assert registry.stats().requests == 0
    other = KvRequestId("other")
    registry.open(other)  # other ids are untouched
    assert registry.is_open(other)
