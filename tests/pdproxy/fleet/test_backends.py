"""Breaker state machine, active health checks, and the admin API."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.fleet.backends import BreakerState, CircuitBreaker
from pdproxy.settings import BreakerSettings
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    backend_entry,
    eventually,
    quick_settings,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(threshold: int = 3, open_s: float = 10.0) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    return CircuitBreaker(BreakerSettings(failure_threshold=threshold, open_s=open_s), clock), clock


def test_breaker_opens_probes_and_closes() -> None:
    b, clock = breaker(threshold=3, open_s=10)
    for _ in range(2):
        b.on_attempt()
        b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now += 9.9
    assert not b.allows()
    clock.now += 0.2
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.on_attempt()  # the one probe
    assert not b.allows()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.allows()


def test_failed_probe_reopens_and_abandoned_probe_frees_slot() -> None:
    b, clock = breaker(threshold=1, open_s=5)
    b.record_failure()
    clock.now += 5
    b.on_attempt()
    b.record_abandoned()
    assert b.allows()  # the probe slot is free again
    b.on_attempt()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    clock.now += 4.9
    assert not b.allows()


def test_success_resets_the_failure_count() -> None:
    b, _ = breaker(threshold=2)
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state is BreakerState.CLOSED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["ok", "fail", "abandon", "tick", "attempt"]), max_size=40))
def test_breaker_invariants(ops: list[str]) -> None:
    b, clock = breaker(threshold=3, open_s=10)
    consecutive = 0
    for op in ops:
        if op == "ok":
            b.record_success()
            consecutive = 0
            assert b.state is BreakerState.CLOSED
        elif op == "fail":
            was_half_open = b.state is BreakerState.HALF_OPEN
            b.record_failure()
            consecutive += 1
            if was_half_open or consecutive >= 3:
                assert b.state is BreakerState.OPEN and not b.allows()
        elif op == "abandon":
            b.record_abandoned()
        elif op == "tick":
            clock.now += 6
        elif op == "attempt" and b.allows():
            b.on_attempt()
            if b.state is BreakerState.HALF_OPEN:
                assert not b.allows()  # at most one probe in flight
        if b.state is BreakerState.CLOSED:
            assert b.allows()
        assert b.state is not BreakerState.OPEN or not b.allows()


async def test_breaker_fed_by_real_outcomes_ejects_a_failing_consumer(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    bad = await fake("Dbad", fail_status=500)
    good = await fake("Dgood")
    px = await proxy(
        quick_settings(
            [backend_entry(bad, "consumer"), backend_entry(good, "consumer")],
            breaker={"failure_threshold": 2, "open_s": 60},
        )
    )
    async with px.client() as c:
        for _ in range(8):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert len(bad.completions()) == 2  # then its breaker opened: no more traffic
    assert len(good.completions()) == 8
    assert 'pdproxy_backend_breaker_state{backend="Dbad"} 2.0' in metrics


async def test_health_checks_eject_and_restore(fake: FakeFactory, proxy: ProxyFactory) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer"), backend_entry(d, "consumer")],
            health={"enabled": True, "interval_s": 0.02, "healthy_threshold": 2,
                    "unhealthy_threshold": 2},
        )
    )  # fmt: skip
    backend = px.state.registry.get("P")
    assert backend is not None
    async with px.client() as c:
        assert (await c.get("/ready")).status_code == 200
        p.behavior.health_status = 503
        await eventually(lambda: not backend.healthy)
        assert (await c.get("/ready")).status_code == 503
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200  # consumer alone: the producer is not routable
        assert p.completions() == []
        p.behavior.health_status = 200
        await eventually(lambda: backend.healthy)
        assert (await c.get("/ready")).status_code == 200
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert len(p.completions()) == 1
    assert px.state.registry.ready()


async def test_admin_api(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d1 = await fake("D1")
    d2 = await fake("D2")
    px = await proxy(quick_settings([backend_entry(d1, "consumer")], admin_key="adm"))
    auth = {"Authorization": "Bearer adm"}
    async with px.client() as c:
        assert (await c.get("/admin/backends")).status_code == 401
        assert (
            await c.get("/admin/backends", headers={"Authorization": "Bearer x"})
        ).status_code == 401
        listed = (await c.get("/admin/backends", headers=auth)).json()["backends"]
        assert [b["name"] for b in listed] == ["D1"]

        r = await c.post("/admin/backends", headers=auth, json=backend_entry(d2, "consumer"))
        assert r.status_code == 201 and r.json()["routable"] is True
        r = await c.post("/admin/backends", headers=auth, json=backend_entry(d2, "consumer"))
        assert r.status_code == 409
        r = await c.post("/admin/backends", headers=auth, json={"name": "x", "url": "ftp://x"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_backend"

        r = await c.post("/admin/backends/D1/drain", headers=auth)
        assert r.json()["draining"] is True and r.json()["routable"] is False
        for _ in range(3):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        assert len(d1.completions()) == 0 and len(d2.completions()) == 3

        assert (await c.post("/admin/backends/D1/undrain", headers=auth)).status_code == 200
        assert (await c.delete("/admin/backends/D2", headers=auth)).status_code == 200
        assert (await c.delete("/admin/backends/D2", headers=auth)).status_code == 404
        for _ in range(2):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    assert len(d1.completions()) == 2 and len(d2.completions()) == 3


async def test_admin_api_is_off_without_key(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(d, "consumer")]))
    async with httpx.AsyncClient(base_url=px.url) as c:
        r = await c.get("/admin/backends", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "admin_disabled"


async def test_draining_turns_readiness_false_but_serves(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(d, "consumer")]))
    px.state.begin_drain()
    async with px.client() as c:
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "draining"
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
