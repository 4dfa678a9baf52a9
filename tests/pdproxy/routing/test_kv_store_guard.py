"""The shared-store guard as a state machine: deadline, breaker, probe, recovery."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.errors import ResidencyUnavailable
from pdproxy.routing.kv.store_guard import BreakerState, StoreGuard
from tests.cancel_eating import CancelEatingCall


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    """A fake store call: answers, fails, or hangs; counts calls that reached it."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.mode == "fail":
            raise ConnectionError("refused")
        if self.mode == "hang":
            await asyncio.sleep(10)
        return "answer"


def make() -> tuple[StoreGuard, Store, Clock, list[BreakerState], list[str]]:
    clock, states, recovered = Clock(), [], []
    guard = StoreGuard(
        deadline_s=0.05, failures=3, cooldown_s=1.0, on_state=states.append, clock=clock
    )
    guard.on_recovered = lambda: recovered.append("recovered")
    return guard, Store(), clock, states, recovered


async def test_scenario_fail_open_probe_recover() -> None:
    guard, store, clock, states, recovered = make()
    assert await guard.call(store, "match") == "answer"
    store.mode = "fail"
    for _ in range(2):
        with pytest.raises(ResidencyUnavailable):
            await guard.call(store, "match")
        clock.now += 0.06
    assert guard.state is BreakerState.CLOSED  # two failures: still closed
    with pytest.raises(ResidencyUnavailable):
        await guard.call(store, "match")
    assert guard.state is BreakerState.OPEN and states == [BreakerState.OPEN]
    # Open: calls fail at once without reaching the store.
    reached = store.calls
    with pytest.raises(ResidencyUnavailable, match="breaker open"):
        await guard.call(store, "match")
    assert store.calls == reached and not guard.allows()
    # After the cooldown one probe goes through; it fails: open again for another cooldown.
    clock.now += 1.0
    assert guard.allows()
    with pytest.raises(ResidencyUnavailable):
        await guard.call(store, "match")
    assert store.calls == reached + 1 and guard.state is BreakerState.OPEN
    # Store back: the next probe closes the breaker and reports recovery.
    store.mode = "ok"
    clock.now += 1.0
    assert await guard.call(store, "match") == "answer"
    assert guard.state is BreakerState.CLOSED
    assert states == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]
    assert recovered == ["recovered"]


async def test_deadline_bounds_a_hanging_store() -> None:
    guard, store, _, _, _ = make()
    store.mode = "hang"
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ResidencyUnavailable):
        await guard.call(store, "match")
    assert loop.time() - t0 < 0.5


async def test_only_one_probe_at_a_time() -> None:
    guard, store, clock, _, _ = make()
    store.mode = "fail"
    for _ in range(3):
        with pytest.raises(ResidencyUnavailable):
            await guard.call(store, "x")
        clock.now += 0.06
    clock.now += 1.0
    store.mode = "hang"
    probe = asyncio.create_task(guard.call(store, "probe"))
    await asyncio.sleep(0)
    assert guard.state is BreakerState.HALF_OPEN and not guard.allows()
    with pytest.raises(ResidencyUnavailable, match="breaker open"):
        await guard.call(store, "other")
    with pytest.raises(ResidencyUnavailable):
        await probe
    assert guard.state is BreakerState.OPEN


async def test_failures_in_one_stall_count_once() -> None:
    guard, store, clock, _, _ = make()
    store.mode = "hang"
    calls = [guard.call(store, what) for what in ("match", "load", "predict", "predict")]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ResidencyUnavailable) for r in results)
    assert guard.state is BreakerState.CLOSED  # four timeouts together are one failure
    store.mode = "fail"
    for _ in range(2):
        clock.now += 0.06
        with pytest.raises(ResidencyUnavailable):
            await guard.call(store, "x")
    assert guard.state is BreakerState.OPEN


async def test_success_resets_the_failure_count() -> None:
    guard, store, clock, _, _ = make()
    for _ in range(5):
        store.mode = "fail"
        for _ in range(2):
            with pytest.raises(ResidencyUnavailable):
                await guard.call(store, "x")
            clock.now += 0.06
        store.mode = "ok"
        await guard.call(store, "x")
    assert guard.state is BreakerState.CLOSED


@pytest.mark.parametrize("then", ["answer", "error"])
async def test_a_cancel_the_client_swallows_still_cancels_the_caller(then: str) -> None:
    """A closing router cancels its heartbeat; if the cancel were lost in the client, the loop
    would run on and close() would wait forever."""
    guard = StoreGuard(deadline_s=5.0, failures=1, cooldown_s=1.0)
    store = CancelEatingCall(then)
    caller = asyncio.create_task(guard.call(store, "heartbeat"))
    await store.entered.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert store.ate == 1
    # Not the store's fault: the breaker counts no failure.
    assert guard.state is BreakerState.CLOSED


async def test_the_deadline_a_client_turns_into_its_own_error_is_a_failure() -> None:
    """The guard's own deadline cancel is not the caller's: it stays a store failure."""
    guard = StoreGuard(deadline_s=0.05, failures=1, cooldown_s=1.0)
    store = CancelEatingCall("error")
    with pytest.raises(ResidencyUnavailable):
        await guard.call(store, "observe")
    assert store.ate == 1
    assert guard.state is BreakerState.OPEN
