"""Round-robin and least-loaded routers over the Router contract."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdproxy.routing.base import NoBackendAvailable, Role, RouteRequest
from pdproxy.routing.simple import LeastLoadedRouter, RoundRobinRouter


@dataclass
class View:
    name: str
    in_flight: int = 0
    role: Role = Role.CONSUMER
    url: str = "http://x"
    routable: bool = True


REQ = RouteRequest(request_id="r", endpoint="completions", body={})


async def test_round_robin_rotates_both_lists_and_ranks_everyone() -> None:
    router = RoundRobinRouter()
    cons = [View("d0"), View("d1"), View("d2")]
    prods = [View("p0", role=Role.PRODUCER), View("p1", role=Role.PRODUCER)]
    firsts = []
    for _ in range(6):
        decision = await router.route(REQ, prods, cons)
        assert sorted(v.name for v in decision.consumers) == ["d0", "d1", "d2"]
        assert sorted(v.name for v in decision.producers) == ["p0", "p1"]
        firsts.append((decision.consumers[0].name, decision.producers[0].name))
    assert [c for c, _ in firsts] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert [p for _, p in firsts] == ["p0", "p1", "p0", "p1", "p0", "p1"]


async def test_no_producers_means_consumer_alone() -> None:
    decision = await RoundRobinRouter().route(REQ, [], [View("d0")])
    assert list(decision.producers) == []


@pytest.mark.parametrize("router", [RoundRobinRouter(), LeastLoadedRouter()])
async def test_no_consumer_raises(router: RoundRobinRouter | LeastLoadedRouter) -> None:
    with pytest.raises(NoBackendAvailable):
        await router.route(REQ, [View("p", role=Role.PRODUCER)], [])


async def test_least_loaded_prefers_fewest_in_flight_and_spreads_ties() -> None:
    router = LeastLoadedRouter()
    cons = [View("d0", in_flight=5), View("d1", in_flight=1), View("d2", in_flight=1)]
    seen = set()
    for _ in range(4):
        decision = await router.route(REQ, [], cons)
        assert decision.consumers[-1].name == "d0"
        seen.add(decision.consumers[0].name)
    assert seen == {"d1", "d2"}
