"""DNS discovery against a real dnsmasq whose records the tests change.

The scenario test runs a bounded load through the proxy while producers (A records) and
consumers (SRV records) come and go, and the DNS server restarts and then disappears: every
request must succeed, and a backend must be out of the registry before its server is stopped.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest

from loadtest.fake_backend import Behavior, FakeBackend
from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.membership.dns import DnsDiscovery, backend_config
from pdproxy.fleet.membership.members import Membership
from pdproxy.routing.base import Role
from pdproxy.settings import BreakerSettings
from pdproxy.settings.membership import DnsDiscoverySettings, DnsGroup, MembershipSettings
from tests.conftest import free_port
from tests.pdproxy.conftest import ProxyFactory, quick_settings
from tests.pdproxy.fleet.membership.dnsmasq import Dnsmasq
from tests.pdproxy.fleet.membership.load import Load

ADMIN = "admin-key-for-membership-tests"
log = logging.getLogger(__name__)


def _group(**values: Any) -> DnsGroup:
    return DnsGroup.model_validate(values)


def _discovery(server: Dnsmasq, groups: list[DnsGroup]) -> tuple[DnsDiscovery, Membership]:
    registry = BackendRegistry(BreakerSettings())
    membership = Membership(registry, MembershipSettings(drain_grace_s=0))
    settings = DnsDiscoverySettings(groups=groups, nameserver=server.nameserver, timeout_s=1.0)
    return DnsDiscovery(settings, membership), membership


def _state(membership: Membership) -> dict[str, bool]:
    return {m.name: m.draining for m in membership.members()}


async def test_a_aaaa_srv_nxdomain_and_outage(dnsmasq: Dnsmasq) -> None:
    dnsmasq.set_hosts("prefill.test", ["127.0.0.2", "127.0.0.3", "::1"])
    dnsmasq.set_hosts("w1.test", ["127.0.0.7"])
    dnsmasq.srv["_http._tcp.decode.test"] = [("w1.test", 8200), ("w1.test", 8201)]
    dnsmasq.start()
    prefill = _group(
        name="prefill", query="prefill.test", port=8100, role="producer", kv_port=5600,
        events_port=5557, models=["m"],
    )  # fmt: skip
    decode = _group(name="decode", query="_http._tcp.decode.test", record="srv", role="consumer")
    ghost = _group(name="ghost", query="nothing.test", port=1, role="consumer")
    discovery, membership = _discovery(dnsmasq, [prefill, decode, ghost])

    found = await discovery.backends(prefill)
    assert [(b.name, b.url, b.kv_address) for b in found] == [
        ("prefill-127.0.0.2-8100", "http://127.0.0.2:8100", "127.0.0.2:5600"),
        ("prefill-127.0.0.3-8100", "http://127.0.0.3:8100", "127.0.0.3:5600"),
        ("prefill---1-8100", "http://[::1]:8100", "[::1]:5600"),
    ]
    assert found[2].events_endpoint == "tcp://[::1]:5557" and found[0].models == ("m",)
    assert [b.url for b in await discovery.backends(decode)] == [
        "http://127.0.0.7:8200", "http://127.0.0.7:8201",
    ]  # fmt: skip
    assert await discovery.backends(ghost) == []  # NXDOMAIN: an empty pool

    await discovery.resolve_all()
    assert len(_state(membership)) == 5
    dnsmasq.set_hosts("prefill.test", ["127.0.0.3"])
    await discovery.resolve_all()
    assert _state(membership)["prefill-127.0.0.2-8100"] is True
    assert _state(membership)["prefill-127.0.0.3-8100"] is False

    dnsmasq.stop()  # outage: every query times out; nothing is drained
    before = _state(membership)
    await discovery.resolve_all()
    assert _state(membership) == before


def test_backend_names_stay_within_the_rules() -> None:
    group = _group(name="g" * 24, query="x.test", port=65535, role=Role.CONSUMER)
    long_v6 = backend_config(group, "fd00:1234:5678:9abc:def0:1234:5678:9abc", 65535)
    assert (
        len(long_v6.name) <= 64
        and long_v6.url == "http://[fd00:1234:5678:9abc:def0:1234:5678:9abc]:65535"
    )
    assert backend_config(group, "fd00:1234:5678:9abc:def0:1234:5678:9abc", 65535) == long_v6


async def test_answer_size_is_capped(dnsmasq: Dnsmasq) -> None:
    dnsmasq.set_hosts("many.test", [f"127.0.1.{i}" for i in range(1, 41)])
    dnsmasq.start()
    group = _group(name="many", query="many.test", port=80, role="consumer")
    registry = BackendRegistry(BreakerSettings())
    membership = Membership(registry, MembershipSettings())
    settings = DnsDiscoverySettings(
        groups=[group], nameserver=dnsmasq.nameserver, max_backends_per_group=16
    )
    await DnsDiscovery(settings, membership).resolve_all()
    assert len(registry.all()) == 16


@pytest.mark.slow
async def test_membership_follows_dnsmasq_under_load(dnsmasq: Dnsmasq, proxy: ProxyFactory) -> None:
    port = free_port()  # every producer listens on the same port, on its own loopback address
    stream = Behavior(chunk_delay_s=0.01, producer_delay_s=0.005)
    p2 = await FakeBackend(
        "p2", Behavior(producer_delay_s=0.005), host="127.0.0.2", port=port
    ).start()
    p3 = await FakeBackend(
        "p3", Behavior(producer_delay_s=0.005), host="127.0.0.3", port=port
    ).start()
    d4 = await FakeBackend("d4", stream, host="127.0.0.4").start()
    d5 = await FakeBackend("d5", stream, host="127.0.0.5").start()
    fakes = [p2, p3, d4, d5]
    try:
        dnsmasq.set_hosts("prefill.test", ["127.0.0.2"])
        dnsmasq.set_hosts("d4.test", ["127.0.0.4"])
        dnsmasq.set_hosts("d5.test", ["127.0.0.5"])
        dnsmasq.srv["_http._tcp.decode.test"] = [("d4.test", d4.port)]
        dnsmasq.start()
        settings = quick_settings(
            [],
            admin_key=ADMIN,
            membership={
                "poll_s": 0.05,
                "drain_grace_s": 0.2,
                "dns": {
                    "nameserver": dnsmasq.nameserver,
                    "interval_s": 0.2,
                    "timeout_s": 0.5,
                    "groups": [
                        {"name": "prefill", "query": "prefill.test", "port": port,
                         "role": "producer"},
                        {"name": "decode", "query": "_http._tcp.decode.test", "record": "srv",
                         "role": "consumer"},
                    ],
                },
            },
        )  # fmt: skip
        running = await proxy(settings)
        registry = running.state.registry
        names = {
            "p2": f"prefill-127.0.0.2-{port}", "p3": f"prefill-127.0.0.3-{port}",
            "d4": f"decode-127.0.0.4-{d4.port}", "d5": f"decode-127.0.0.5-{d5.port}",
        }  # fmt: skip
        assert {b.name for b in registry.all()} == {names["p2"], names["d4"]}

        async with Load(running.url, concurrency=4) as load:
            await load.until(lambda: load.ok >= 20)
            # A producer joins.
            t = time.monotonic()
            dnsmasq.set_hosts("prefill.test", ["127.0.0.2", "127.0.0.3"])
            await load.until(lambda: registry.get(names["p3"]) is not None)
            log.info("A record added: joined in %.2f s", time.monotonic() - t)
            await load.until(lambda: len(p3.producer_legs()) >= 5)
            # A producer leaves: drained, removed once idle, and only then stopped.
            t = time.monotonic()
            dnsmasq.set_hosts("prefill.test", ["127.0.0.3"])
            await load.until(lambda: registry.get(names["p2"]) is None)
            log.info("A record removed: drained and removed in %.2f s", time.monotonic() - t)
            await p2.stop()
            # The SRV target moves (dnsmasq restarts: a short outage in between).
            t = time.monotonic()
            dnsmasq.set_srv("_http._tcp.decode.test", [("d5.test", d5.port)])
            await load.until(lambda: registry.get(names["d4"]) is None)
            log.info("SRV target moved: old one removed in %.2f s", time.monotonic() - t)
            assert d4.aborts == 0  # the drain let its streams finish
            await d4.stop()
            served = len(d5.consumer_legs())
            await load.until(lambda: len(d5.consumer_legs()) >= served + 10)
            # The DNS server goes away: the backends stay.
            dnsmasq.stop()
            ok = load.ok
            await load.until(lambda: load.ok >= ok + 40)
            assert {b.name for b in registry.all()} == {names["p3"], names["d5"]}

            async with httpx.AsyncClient(base_url=running.url) as admin:
                listed = (
                    await admin.get("/admin/members", headers={"authorization": f"Bearer {ADMIN}"})
                ).json()["members"]
            assert {(m["name"], m["source"], m["state"]) for m in listed} == {
                (names["p3"], "dns", "active"), (names["d5"], "dns", "active"),
            }  # fmt: skip
        log.info("load: %d requests sent, %d ok, %d failed", load.sent, load.ok, len(load.failures))
        assert load.failures == []
        assert load.ok == load.sent and load.sent >= 75  # what the waits above guarantee
    finally:
        for fake in fakes:
            await fake.stop()
