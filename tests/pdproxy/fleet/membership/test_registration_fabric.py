"""Stock vLLM's registration without CURVE (``registration.trusted_fabric``), and its attackers.

vLLM's own sender is a plain DEALER (no CURVE). The fabric socket admits it by source address
only (the ZAP handler, before a message is read); everything after is the authenticated path's:
own-address rule, names, caps, rates, draining, the admin view. Rules (threat model in
``pdproxy/fleet/membership/fabric.py`` and docs/security.md):

- off by default; on only with source networks, never "every address";
- a peer whose source address is outside the networks registers, drains and replaces nothing
  (the ZAP handler refuses its handshake) while an admitted peer registers beside it;
- an admitted peer is held to its own address and to the same caps and rates as a key;
- it cannot drain or replace what a CURVE key registered, nor the reverse;
- a plain peer on the CURVE socket still gets nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.membership.members import Membership
from pdproxy.fleet.membership.registration import RegistrationListener
from pdproxy.routing.base import Role
from pdproxy.settings import BackendConfig, BreakerSettings
from pdproxy.settings.membership import MembershipSettings, RegistrationSettings
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, eventually, quick_settings
from tests.pdproxy.fleet.membership.conftest import RegistrationKeys
from tests.pdproxy.fleet.membership.registrant import Registrant, vllm_message

ADMIN = "admin-key-fabric"


def moriio_message(kind: str, http_port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    """What vLLM 0.32's MoRIIO connector heartbeat sends (``_start_heartbeat``'s payload)."""
    return {
        "type": kind,
        "http_address": f"{host}:{http_port}",
        "zmq_address": f"host:{host},handshake:6301,notify:6302",
        "dp_size": 1,
        "tp_size": 1,
        "transfer_mode": "READ",
    }


@dataclass
class Fabric:
    listener: RegistrationListener
    registry: BackendRegistry
    membership: Membership
    metrics: CollectorRegistry

    def outcome(self, label: str) -> float:
        value = self.metrics.get_sample_value(
            "pdproxy_registration_messages_total", {"outcome": label}
        )
        return value or 0.0

    def peer(self, source: str = "127.0.0.1") -> Registrant:
        """A plain DEALER (as vLLM's) connecting from ``source``."""
        endpoint = self.listener.fabric_endpoint
        assert endpoint is not None
        port = endpoint.rsplit(":", 1)[1]
        return Registrant(f"tcp://{source}:0;127.0.0.1:{port}", secret=None, server_public=None)

    def names(self) -> set[str]:
        return {b.name for b in self.registry.all()}


async def fabric_listener(
    networks: list[str], keys: RegistrationKeys | None = None, **limits: Any
) -> Fabric:
    registry = BackendRegistry(BreakerSettings())
    registry.add(BackendConfig(name="static", url="http://127.0.0.1:9", role=Role.CONSUMER))
    membership = Membership(registry, MembershipSettings(drain_grace_s=0))
    metrics = CollectorRegistry()
    curve: dict[str, Any] = {}
    if keys is not None:
        curve = {
            "endpoint": "tcp://127.0.0.1:0",
            "curve_secret_key_file": keys.proxy_secret,
            "curve_clients_dir": keys.clients_dir,
        }
    settings = RegistrationSettings(
        trusted_fabric={"endpoint": "tcp://127.0.0.1:0", "networks": networks},
        max_message_bytes=1024,
        handshake_timeout_s=1.0,
        **curve,
        **limits,
    )
    listener = RegistrationListener(settings, membership, metrics_registry=metrics)
    await listener.start()
    return Fabric(listener, registry, membership, metrics)


@pytest.fixture
async def fabric() -> AsyncIterator[Fabric]:
    ctx = await fabric_listener(["127.0.0.1/32"], max_registrants=3, max_messages_per_key_s=20)
    try:
        yield ctx
    finally:
        await ctx.listener.close()


def test_off_by_default_and_never_for_every_address() -> None:
    settings = RegistrationSettings()
    assert settings.trusted_fabric.endpoint is None and not settings.listens
    with pytest.raises(ValidationError, match="needs networks"):
        RegistrationSettings(trusted_fabric={"endpoint": "tcp://127.0.0.1:0"})
    for everyone in ("0.0.0.0/0", "::/0"):
        with pytest.raises(ValidationError, match="admits every address"):
            RegistrationSettings(
                trusted_fabric={"endpoint": "tcp://127.0.0.1:0", "networks": [everyone]}
            )
    alone = RegistrationSettings(
        trusted_fabric={"endpoint": "tcp://127.0.0.1:0", "networks": ["10.0.0.0/8"]}
    )
    assert alone.listens and alone.endpoint is None  # no CURVE socket needed beside it


async def test_a_stock_vllm_message_registers_refreshes_and_expires(fabric: Fabric) -> None:
    peer = fabric.peer()
    try:
        assert await peer.send(moriio_message("D", 8100))
        await eventually(lambda: "reg-127.0.0.1-8100" in fabric.names(), 5)
        member = fabric.membership.get("reg-127.0.0.1-8100")
        assert member is not None and member.owner == "fabric:127.0.0.1"
        assert member.backend.role is Role.CONSUMER
        assert member.backend.config.kv_address is None  # MoRIIO's packed ports stay opaque
        await peer.send(moriio_message("D", 8100))
        await eventually(lambda: fabric.outcome("refreshed") >= 1, 5)
        fabric.membership.expire("registration", 0.0)  # silent: drained like a keyed registrant
        assert member.draining
        assert fabric.membership.sweep() == ["reg-127.0.0.1-8100"]
    finally:
        peer.close()


async def test_a_peer_outside_the_networks_gets_nothing(fabric: Fabric) -> None:
    inside = fabric.peer("127.0.0.1")
    outside = fabric.peer("127.0.0.2")
    try:
        await inside.send(moriio_message("P", 8100))
        await eventually(lambda: "reg-127.0.0.1-8100" in fabric.names(), 5)
        for port in range(9000, 9005):
            await outside.send(moriio_message("P", port, host="127.0.0.2"))
            await outside.send(vllm_message("P", port))
        await outside.send(vllm_message("P", 8100, leaving=True))  # not its to drain anyway
        await eventually(lambda: fabric.listener.refused_fabric_peers >= 1, 5)
        await asyncio.sleep(0.3)
        assert fabric.names() == {"static", "reg-127.0.0.1-8100"}
        assert fabric.outcome("joined") == 1 and fabric.outcome("left") == 0
        member = fabric.membership.get("reg-127.0.0.1-8100")
        assert member is not None and not member.draining
    finally:
        inside.close()
        outside.close()


async def test_an_admitted_peer_is_held_to_its_address_names_and_caps(fabric: Fabric) -> None:
    peer = fabric.peer()
    try:
        await peer.send(moriio_message("P", 8100, host="10.0.0.9"))  # not its own address
        await peer.send(vllm_message("P", 8101, name="static"))  # a configured backend's name
        for port in range(8200, 8210):  # past max_registrants (3)
            await peer.send(vllm_message("P", port))
        await eventually(lambda: fabric.outcome("full") >= 1, 5)
        assert fabric.outcome("address") == 1 and fabric.outcome("conflict") == 1
        assert fabric.membership.count("registration") == 3
        registered = {m.name for m in fabric.membership.members("registration")}
        assert registered == {f"reg-127.0.0.1-{p}" for p in (8200, 8201, 8202)}
    finally:
        peer.close()


async def test_rates_bound_one_address() -> None:
    ctx = await fabric_listener(["127.0.0.0/8"], max_messages_per_key_s=5)
    peer = ctx.peer()
    try:
        for _ in range(100):
            await peer.send(vllm_message("P", 8100))
        await eventually(lambda: ctx.outcome("joined") + ctx.outcome("refreshed") + (
            ctx.outcome("rate")) == 100, 10)  # fmt: skip
        assert ctx.outcome("rate") >= 80  # about 5 a second get through
    finally:
        peer.close()
        await ctx.listener.close()


async def test_fabric_and_keys_cannot_touch_each_others_backends(
    registration_keys: RegistrationKeys,
) -> None:
    ctx = await fabric_listener(["127.0.0.1/32"], registration_keys)
    assert ctx.listener.endpoint is not None
    keyed = Registrant(
        ctx.listener.endpoint, secret=registration_keys.worker_secret,
        server_public=registration_keys.proxy_public,
    )  # fmt: skip
    plain_on_curve = Registrant(ctx.listener.endpoint, secret=None, server_public=None)
    peer = ctx.peer()
    try:
        await keyed.send(vllm_message("D", 8100))
        await peer.send(vllm_message("D", 8200))
        await eventually(lambda: {"reg-127.0.0.1-8100", "reg-127.0.0.1-8200"} <= ctx.names(), 5)
        await peer.send(vllm_message("D", 8100, leaving=True))  # the key's backend
        await keyed.send(vllm_message("D", 8200, leaving=True))  # the fabric's backend
        await plain_on_curve.send(vllm_message("D", 8300))  # plain on the CURVE socket
        await eventually(lambda: ctx.outcome("owner") == 2, 5)
        await asyncio.sleep(0.3)
        assert "reg-127.0.0.1-8300" not in ctx.names()
        for name in ("reg-127.0.0.1-8100", "reg-127.0.0.1-8200"):
            member = ctx.membership.get(name)
            assert member is not None and not member.draining
    finally:
        for registrant in (keyed, plain_on_curve, peer):
            registrant.close()
        await ctx.listener.close()


async def test_a_fabric_registrant_serves_drains_and_is_listed(
    proxy: ProxyFactory, fake: FakeFactory
) -> None:
    """Through the app: registered, listed by the admin API with its address as owner, served,
    then drained and removed once its heartbeats stop."""
    consumer = await fake("D")
    settings = quick_settings(
        [],
        admin_key=ADMIN,
        membership={
            "poll_s": 0.05,
            "drain_grace_s": 0.2,
            "registration": {
                "trusted_fabric": {"endpoint": "tcp://127.0.0.1:0", "networks": ["127.0.0.1/32"]},
                "heartbeat_timeout_s": 1.0,
                "dialect": "none",
            },
        },
    )
    running = await proxy(settings)
    endpoint = running.state.membership.registration.fabric_endpoint
    assert endpoint is not None
    peer = Registrant(endpoint, secret=None, server_public=None)
    name = f"reg-127.0.0.1-{consumer.port}"
    registry = running.state.registry
    try:
        await peer.send(moriio_message("D", consumer.port))
        await eventually(lambda: registry.get(name) is not None, 5)
        async with httpx.AsyncClient(base_url=running.url) as client:
            listed = await client.get(
                "/admin/members", headers={"authorization": f"Bearer {ADMIN}"}
            )
            [member] = listed.json()["members"]
            assert (member["name"], member["owner"], member["state"]) == (
                name, "fabric:127.0.0.1", "active",
            )  # fmt: skip
            body = {"model": "m", "prompt": "hello", "max_tokens": 4}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 200
        await eventually(lambda: registry.get(name) is None, 10)  # no heartbeat: drained, gone
    finally:
        peer.close()
