"""The filter chain that narrows a request's candidates before any router ranks them: role,
routable (once, here), model and adapter, dialect pool."""

from __future__ import annotations

import pytest

from pdproxy.errors import NoBackendAvailable
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.models import ModelRef
from pdproxy.routing.candidates import acting_as, candidates, routable, serving
from pdproxy.settings import BackendConfig, BreakerSettings, Dialect, Role


def registry(*entries: tuple[str, Role, Dialect, list[str]]) -> BackendRegistry:
    reg = BackendRegistry(BreakerSettings())
    for name, role, dialect, models in entries:
        reg.add(
            BackendConfig(
                name=name, url=f"http://{name}:1", role=role, dialect=dialect, models=models
            )
        )
    return reg


def names(backends: list[Backend]) -> list[str]:
    return [b.name for b in backends]


P2P = Dialect.P2P


def test_unroutable_backends_are_never_candidates() -> None:
    reg = registry(
        ("p0", Role.PRODUCER, P2P, []), ("c0", Role.CONSUMER, P2P, []),
        ("c1", Role.CONSUMER, P2P, []),
    )  # fmt: skip
    backends = {b.name: b for b in reg.all()}
    backends["c0"].healthy = False
    backends["c1"].draining = True
    with pytest.raises(NoBackendAvailable):
        candidates(reg, with_producers=True)
    backends["c1"].draining = False
    backends["p0"].healthy = False
    pool = candidates(reg, with_producers=True)
    assert names(pool.consumers) == ["c1"] and pool.producers == []


def test_roles_and_the_aggregated_dialect_never_produce() -> None:
    reg = registry(
        ("b0", Role.BOTH, P2P, []), ("p0", Role.PRODUCER, P2P, []),
        ("agg", Role.BOTH, Dialect.NONE, []), ("c0", Role.CONSUMER, P2P, []),
    )  # fmt: skip
    assert names(routable(acting_as(reg.all(), Role.PRODUCER))) == ["b0", "p0"]
    assert names(acting_as(reg.all(), Role.CONSUMER)) == ["b0", "agg", "c0"]


def test_the_least_loaded_dialect_pool_serves_and_brings_its_producers() -> None:
    reg = registry(
        ("pn", Role.PRODUCER, Dialect.NIXL, []), ("cn", Role.CONSUMER, Dialect.NIXL, []),
        ("pp", Role.PRODUCER, P2P, []), ("cp", Role.CONSUMER, P2P, []),
    )  # fmt: skip
    pool = candidates(reg, with_producers=True)
    assert pool.dialect is Dialect.NIXL  # a tie: nixl first
    assert names(pool.producers) == ["pn"] and names(pool.consumers) == ["cn"]
    {b.name: b for b in reg.all()}["cn"].begin()
    pool = candidates(reg, with_producers=True)
    assert pool.dialect is P2P and names(pool.producers) == ["pp"]
    assert candidates(reg, with_producers=False).producers == []


def test_an_adapter_goes_where_it_is_loaded_else_on_demand_to_its_base() -> None:
    reg = registry(
        ("c0", Role.CONSUMER, P2P, ["base", "style"]), ("c1", Role.CONSUMER, P2P, ["base"]),
    )  # fmt: skip
    adapter = ModelRef("style", base="base", load_on_demand=True)
    assert names(serving(reg.all(), adapter)) == ["c0"]
    {b.name: b for b in reg.all()}["c0"].healthy = False
    assert names(candidates(reg, with_producers=False, model=adapter).consumers) == ["c1"]
    pinned = ModelRef("style", base="base")
    with pytest.raises(NoBackendAvailable, match="for model 'style'"):
        candidates(reg, with_producers=False, model=pinned)
