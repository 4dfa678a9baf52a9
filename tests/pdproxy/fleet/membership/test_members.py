"""The membership mechanism: join, refresh, replace, drain, and removal only once idle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.membership.errors import MemberConflict
from pdproxy.fleet.membership.members import Membership
from pdproxy.routing.base import Role
from pdproxy.settings import BackendConfig, BreakerSettings
from pdproxy.settings.membership import MembershipSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def config(
    name: str, port: int = 8000, role: Role = Role.CONSUMER, **extra: object
) -> BackendConfig:
    return BackendConfig.model_validate(
        {"name": name, "url": f"http://127.0.0.1:{port}", "role": role, **extra}
    )


def setup(grace: float = 1.0, timeout: float = 60.0) -> tuple[BackendRegistry, Membership, Clock]:
    clock = Clock()
    registry = BackendRegistry(BreakerSettings(), clock)
    membership = Membership(
        registry, MembershipSettings(drain_grace_s=grace, drain_timeout_s=timeout), clock=clock
    )
    return registry, membership, clock


def test_join_refresh_and_drain_then_remove_when_idle() -> None:
    registry, membership, clock = setup()
    membership.join("dns", "decode", config("d1"))
    backend = registry.get("d1")
    assert backend is not None and backend.routable
    backend.begin()  # a leg in flight
    membership.leave("d1", "gone from dns")
    assert not backend.routable and registry.consumers() == []
    clock.now += 50
    assert membership.sweep() == []  # legs in flight: only the drain timeout would remove it
    assert registry.get("d1") is backend
    backend.end()
    assert membership.sweep() == []  # idle now, the grace period starts
    clock.now += 0.5
    assert membership.sweep() == []
    clock.now += 0.6
    assert membership.sweep() == ["d1"]
    assert registry.get("d1") is None and backend.removed
    assert membership.members() == []


def test_drain_timeout_removes_a_backend_with_legs_still_in_flight() -> None:
    registry, membership, clock = setup(timeout=30.0)
    membership.join("registration", "k1", config("w1"))
    backend = registry.get("w1")
    assert backend is not None
    backend.begin()
    membership.leave("w1", "no heartbeat")
    clock.now += 29
    assert membership.sweep() == []
    clock.now += 2
    assert membership.sweep() == ["w1"]
    backend.end()  # the leg still ends on its own object
    assert backend.in_flight == 0


def test_rejoin_while_draining_undrains() -> None:
    registry, membership, clock = setup()
    membership.join("dns", "g", config("d1"))
    membership.leave("d1", "gone")
    clock.now += 0.5
    membership.join("dns", "g", config("d1"))
    backend = registry.get("d1")
    assert backend is not None and backend.routable
    clock.now += 10
    assert membership.sweep() == []


def test_changed_config_replaces_and_in_flight_legs_keep_the_old_object() -> None:
    registry, membership, _ = setup()
    membership.join("registration", "k1", config("w1", models=("a",)))
    old = registry.get("w1")
    assert old is not None
    old.begin()
    membership.join("registration", "k1", config("w1", models=("a", "b")))
    new = registry.get("w1")
    assert new is not None and new is not old and new.config.models == ("a", "b")
    assert old.removed and old.in_flight == 1
    old.end()


def test_a_source_cannot_take_a_configured_or_foreign_backend() -> None:
    registry, membership, _ = setup()
    static = registry.add(config("static"))
    with pytest.raises(MemberConflict):
        membership.join("registration", "k1", config("static", port=9999))
    assert registry.get("static") is static and static.url.endswith(":8000")
    membership.join("dns", "g1", config("d1"))
    with pytest.raises(MemberConflict):
        membership.join("dns", "g2", config("d1", port=9999))
    with pytest.raises(MemberConflict):
        membership.join("registration", "k1", config("d1", port=9999))
    member = membership.get("d1")
    assert member is not None and member.owner == "g1" and member.backend.url.endswith(":8000")


def test_sync_drains_only_the_owners_vanished_backends() -> None:
    _registry, membership, _ = setup()
    membership.sync("dns", "a", [config("a1"), config("a2")])
    membership.sync("dns", "b", [config("b1")])
    membership.sync("dns", "a", [config("a2"), config("a3")])
    states = {m.name: m.draining for m in membership.members()}
    assert states == {"a1": True, "a2": False, "a3": False, "b1": False}


def test_admin_removal_is_noticed() -> None:
    registry, membership, _clock = setup(grace=0)
    membership.join("dns", "g", config("d1"))
    registry.remove("d1")  # DELETE /admin/backends/d1
    membership.join("dns", "g", config("d1"))  # the next round brings it back
    assert registry.get("d1") is not None
    registry.remove("d1")
    membership.leave("d1", "gone")
    assert membership.sweep() == [] and membership.members() == []


def test_admin_undrain_wins_over_a_membership_drain() -> None:
    registry, membership, clock = setup(grace=0)
    membership.join("dns", "g", config("d1"))
    membership.leave("d1", "gone")
    backend = registry.get("d1")
    assert backend is not None
    backend.draining = False  # POST /admin/backends/d1/undrain
    clock.now += 10
    assert membership.sweep() == [] and registry.get("d1") is backend and backend.routable
    member = membership.get("d1")
    assert member is not None and not member.draining


def test_an_admin_drain_holds_until_the_admin_undrains() -> None:
    """The operator wins over a source: leaving and coming back, or a changed config, do not
    undo an admin drain; the admin's undrain does."""
    registry, membership, clock = setup(grace=5)
    membership.join("registration", "k", config("w1"))
    backend = registry.get("w1")
    assert backend is not None
    backend.draining = True  # POST /admin/backends/w1/drain
    membership.leave("w1", "announced leaving")
    clock.now += 1
    membership.join("registration", "k", config("w1"))
    membership.join("registration", "k", config("w1", port=8001))
    live = registry.get("w1")
    assert live is not None and live.draining and membership.sweep() == []
    live.draining = False  # POST /admin/backends/w1/undrain
    membership.sweep()
    membership.join("registration", "k", config("w1", port=8002))
    live = registry.get("w1")
    assert live is not None and live.routable


def test_expire_drains_the_silent() -> None:
    _, membership, clock = setup()
    membership.join("registration", "k", config("w1"))
    membership.join("registration", "k", config("w2", port=8001))
    clock.now += 4
    membership.join("registration", "k", config("w2", port=8001))
    clock.now += 2
    membership.expire("registration", 5.0)
    assert {m.name: m.draining for m in membership.members()} == {"w1": True, "w2": False}


_ops = st.lists(
    st.tuples(
        st.sampled_from(["join", "leave", "begin", "end", "tick", "sweep", "change"]),
        st.integers(0, 2),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_never_removed_with_legs_in_flight_before_the_timeout(ops: list[tuple[str, int]]) -> None:
    """Invariants over any sequence: a drain removes a backend only once it has no leg in
    flight (the drain timeout is out of reach here); a draining backend is never routable;
    the registry holds each member's own backend under its name."""
    registry, membership, clock = setup(grace=0.5, timeout=1e9)
    held: list[Backend] = []
    for op, i in ops:
        name = f"b{i}"
        if op == "join":
            membership.join("dns", "g", config(name, port=8000 + i))
        elif op == "change":
            membership.join("dns", "g", config(name, port=9000 + i))
        elif op == "leave":
            membership.leave(name, "test")
        elif op == "begin" and (b := registry.get(name)) is not None and b.routable:
            b.begin()
            held.append(b)
        elif op == "end" and held:
            held.pop(i % len(held)).end()
        elif op == "tick":
            clock.now += 0.3
        elif op == "sweep":
            before = {m.name: m.backend for m in membership.members()}
            for removed in membership.sweep():
                assert before[removed].in_flight == 0
                assert before[removed].removed and registry.get(removed) is None
        for member in membership.members():
            assert registry.get(member.name) is member.backend
            if member.draining:
                assert not member.backend.routable
