"""The request lease: whatever a request does, everything it took is given back exactly once.

A property test drives one lease through random interleavings of what the request path does
(legs on several backends that succeed, fail, are refused or are abandoned; producer supplies
taken and dropped; closes from the response and from a cancelled task) and checks the
invariants at the end: no backend still counted in flight, the admission slot back, the router
told exactly once, each dropped supply released once, the live supply released once unless the
request succeeded, and a suspect's breaker charged only when the request succeeded elsewhere
(otherwise a health check is asked for instead).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.errors import LegFailed
from pdproxy.fleet.backends import BackendRegistry, BreakerState
from pdproxy.front.admission import Admission
from pdproxy.front.intake import Endpoint
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.lease import BackendHold, RequestLease
from pdproxy.request.legs import KvRequestId
from pdproxy.request.record import LegRequestId, RequestId, RequestRecord
from pdproxy.request.release import Supply, SupplyReleaser
from pdproxy.routing.base import RequestOutcome, Role, RouteDecision
from pdproxy.settings import (
    AdmissionSettings,
    BackendConfig,
    BreakerSettings,
    Dialect,
    TimeoutSettings,
    UpstreamSettings,
)
from pdproxy.upstream.client import Upstream


class RecordingReleaser(SupplyReleaser):
    """Records releases instead of sending them."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        super().__init__(Upstream(TimeoutSettings(), UpstreamSettings()), metrics)
        self.released: list[tuple[KvRequestId, LegRequestId]] = []

    def release(self, supply: Supply, request_id: LegRequestId) -> None:
        self.released.append((supply.kv_request_id, request_id))


class CountingRouter:
    def __init__(self) -> None:
        self.outcomes: list[RequestOutcome] = []

    async def start(self) -> None:
        return None

    async def route(self, *args: Any) -> Any:
        raise AssertionError("not used")

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        self.outcomes.append(outcome)

    async def close(self) -> None:
        return None


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("leg"), st.integers(0, 2), st.sampled_from(["ok", "fail", "4xx", "x"])),
        st.tuples(st.just("supply"), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("release_again"), st.integers(0, 5), st.just("")),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, ok=st.booleans(), extra_closes=st.integers(0, 2), routed=st.booleans())
def test_every_path_gives_everything_back_once(
    ops: list[tuple[str, int, Any]], ok: bool, extra_closes: int, routed: bool
) -> None:
    asyncio.run(_scenario(ops, ok, extra_closes, routed))


async def _scenario(
    ops: list[tuple[str, int, Any]], ok: bool, extra_closes: int, routed: bool
) -> None:
    # One failure opens a breaker: its state tells whether the lease charged it.
    registry = BackendRegistry(BreakerSettings(failure_threshold=1, open_s=60))
    backends = [
        registry.add(BackendConfig(name=f"b{i}", url=f"http://h{i}:1", role=Role.BOTH))
        for i in range(3)
    ]
    admission = Admission(AdmissionSettings(max_concurrent=1, queue_size=0))
    metrics = ProxyMetrics(registry, lambda: 0)
    releaser = RecordingReleaser(metrics)
    router = CountingRouter()
    confirmed: list[str] = []
    record = RequestRecord(RequestId("r" * 32), None, Endpoint.COMPLETIONS, 0.0)
    lease = RequestLease(
        record.request_id,
        admission=admission,
        router=router,
        releaser=releaser,
        metrics=metrics,
        confirm_failure=lambda b: confirmed.append(b.name),
    )
    await lease.admit()
    if routed:
        lease.decision = RouteDecision("r" * 32, consumers=backends, producers=backends)

    holds: list[BackendHold] = []
    dropped: list[KvRequestId] = []
    suspects: list[str] = []
    live: KvRequestId | None = None
    for kind, i, arg in ops:
        if kind == "leg":
            hold = lease.hold(backends[i])
            holds.append(hold)
            if arg == "ok":
                hold.succeeded()
            elif arg == "fail":
                hold.failed(LegFailed(backends[i].name, "status 500", status=500))
                suspects.append(backends[i].name)
            elif arg == "4xx":
                hold.refused()
            if arg != "x" or i == 0:  # some abandoned legs stay open until close
                hold.release()
        elif kind == "supply":
            supply = Supply(backends[i], KvRequestId(f"kv{len(dropped)}-{i}"), Dialect.P2P)
            if arg:
                lease.drop_supply(supply)
                dropped.append(supply.kv_request_id)
            else:
                lease.supply = supply
                live = supply.kv_request_id
        elif holds:
            holds[i % len(holds)].release()  # releasing twice is harmless

    assert all(b.breaker.state is BreakerState.CLOSED for b in backends)
    await lease.close(ok, 200 if ok else 502, record)
    for _ in range(extra_closes):
        await lease.close(not ok, 500, record)

    assert all(b.in_flight == 0 for b in backends)
    assert admission.active == 0
    assert len(router.outcomes) == (1 if routed else 0)
    if routed:
        assert router.outcomes[0].ok is ok
    released = [kv for kv, _ in releaser.released]
    expected = dropped + ([live] if live is not None and not ok else [])
    assert sorted(released) == sorted(expected)
    leg_ids = [rid for _, rid in releaser.released]
    assert len(set(leg_ids)) == len(leg_ids)  # every release call carries its own id
    for b in backends:
        charged = b.breaker.state is BreakerState.OPEN
        assert charged == (ok and b.name in suspects)
    assert sorted(confirmed) == ([] if ok else sorted(suspects))
