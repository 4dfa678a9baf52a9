"""Admission control: the limiter alone, then through the proxy (429 + Retry-After)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from pdproxy.errors import Overloaded
from pdproxy.front.admission import Admission, ModelAdmission, ModelMetrics
from pdproxy.settings import AdmissionSettings
from pdproxy.settings.models import ModelsSettings
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    backend_entry,
    eventually,
    quick_settings,
)


def limiter(max_concurrent: int = 1, queue_size: int = 1, timeout: float = 5.0) -> Admission:
    return Admission(
        AdmissionSettings(
            max_concurrent=max_concurrent, queue_size=queue_size, queue_timeout_s=timeout
        )
    )


async def test_slots_pass_to_waiters_in_order() -> None:
    adm = limiter(max_concurrent=1, queue_size=3)
    await adm.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await adm.acquire()
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await eventually(lambda: adm.queue_depth == 3)
    for expected in range(3):
        adm.release()
        await eventually(lambda n=expected: len(order) == n + 1)
    assert order == [0, 1, 2]
    await asyncio.gather(*tasks)
    assert adm.active == 1
    adm.release()
    assert adm.active == 0


async def test_full_queue_is_refused_with_retry_after() -> None:
    adm = limiter(max_concurrent=1, queue_size=0)
    await adm.acquire()
    with pytest.raises(Overloaded) as info:
        await adm.acquire()
    assert info.value.status == 429
    assert int(info.value.headers["retry-after"]) >= 1


async def test_wait_times_out() -> None:
    adm = limiter(max_concurrent=1, queue_size=1, timeout=0.05)
    await adm.acquire()
    with pytest.raises(Overloaded, match="timed out"):
        await adm.acquire()
    assert adm.queue_depth == 0
    adm.release()
    assert adm.active == 0


async def test_cancelled_waiter_leaves_no_trace() -> None:
    adm = limiter(max_concurrent=1, queue_size=2)
    await adm.acquire()
    task = asyncio.create_task(adm.acquire())
    await eventually(lambda: adm.queue_depth == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adm.queue_depth == 0
    adm.release()
    assert adm.active == 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(0, 4),
    st.lists(st.sampled_from(["acquire", "release", "cancel"]), max_size=30),
)
def test_never_more_than_max_concurrent(max_c: int, queue: int, ops: list[str]) -> None:
    async def scenario() -> None:
        adm = limiter(max_concurrent=max_c, queue_size=queue, timeout=10)
        holders = 0
        waiting: list[asyncio.Task[None]] = []
        for op in ops:
            if op == "acquire":
                task = asyncio.create_task(adm.acquire())
                await asyncio.sleep(0)
                if task.done():
                    if task.exception() is None:
                        holders += 1
                    else:
                        assert isinstance(task.exception(), Overloaded)
                else:
                    waiting.append(task)
            elif op == "release" and holders:
                adm.release()
                holders -= 1
                await asyncio.sleep(0)
            elif op == "cancel" and waiting:
                waiting.pop(0).cancel()
                await asyncio.sleep(0)
            for task in list(waiting):
                if task.done():
                    waiting.remove(task)
                    if not task.cancelled():
                        holders += 1
            assert adm.active == holders <= max_c
            assert adm.queue_depth <= queue
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(scenario())


async def test_proxy_answers_429_when_queue_is_full(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D", first_chunk_delay_s=0.5)
    px = await proxy(
        quick_settings(
            [backend_entry(d, "consumer")],
            admission={"max_concurrent": 1, "queue_size": 0},
        )
    )
    async with px.client() as c:
        slow = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x"}))
        await eventually(lambda: len(d.received) == 1)
        r = await c.post("/v1/completions", json={"prompt": "y"})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "5"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert (await slow).status_code == 200
    assert len(d.received) == 1


async def test_a_forgotten_models_bucket_goes_once_idle() -> None:
    """A forgotten label keeps its bucket while a request is in flight, then loses it and its
    series; a label named again before that is kept."""
    registry = CollectorRegistry()
    admission = ModelAdmission(ModelsSettings())
    ModelMetrics(registry, admission)
    slot = await admission.acquire("gamma")
    (await admission.acquire("delta")).release(200)
    admission.forget(("gamma", "delta"))
    labels = {label for label, _, _ in admission.snapshot()}
    assert labels == {"gamma"}
    assert (
        registry.get_sample_value(
            "pdproxy_model_requests_total", {"model": "delta", "status": "200"}
        )
        is None
    )
    slot.release(200)
    assert admission.snapshot() == []
    text = generate_latest(registry).decode()
    assert 'model="gamma"' not in text and 'model="delta"' not in text
    kept = await admission.acquire("gamma")
    admission.forget(("gamma",))
    await admission.acquire("gamma")  # named again: no longer forgotten
    kept.release(200)
    assert [label for label, _, _ in admission.snapshot()] == ["gamma"]
