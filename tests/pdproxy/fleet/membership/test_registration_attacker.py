"""The registration listener, played by an attacker.

Every negative test keeps an admitted worker beside the attacker, so "nothing happened" is
measured while the same listener demonstrably registers the worker. Rules (threat model in
``pdproxy/fleet/membership/registration.py`` and docs/security.md):

- no key, or a key the proxy does not admit: nothing is registered, drained or replaced;
- a message over the size cap: the connection is dropped, nothing is decoded;
- an admitted key may announce only its own address, never a configured backend's name, a DNS
  group's (future) name or another key's backend, and not past the registrant cap, the model
  caps or the message rates;
- a sender is its key, not the routing id it chose; a deleted key is out without a restart.

What an admitted key may claim (model names, backend names, undoing an operator's removal) is
played through ``accept`` in ``test_registration_claims``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvtier.events.curve import write_certificate
from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.membership.members import Membership
from pdproxy.fleet.membership.registration import RegistrationListener
from pdproxy.routing.base import Role
from pdproxy.settings import BackendConfig, BreakerSettings
from pdproxy.settings.membership import (
    MembershipSettings,
    RegistrationSettings,
)
from tests.pdproxy.conftest import eventually
from tests.pdproxy.fleet.membership.conftest import RegistrationKeys
from tests.pdproxy.fleet.membership.registrant import Registrant, vllm_message


@dataclass
class Listening:
    listener: RegistrationListener
    registry: BackendRegistry
    membership: Membership
    metrics: CollectorRegistry
    endpoint: str
    keys: RegistrationKeys

    def outcome(self, label: str) -> float:
        value = self.metrics.get_sample_value(
            "pdproxy_registration_messages_total", {"outcome": label}
        )
        return value or 0.0

    def registrant(self, secret: Path | None, identity: str = "10.0.0.1:21001") -> Registrant:
        return Registrant(
            self.endpoint, secret=secret, server_public=self.keys.proxy_public, identity=identity
        )

    def names(self) -> set[str]:
        return {b.name for b in self.registry.all()}


@pytest.fixture
async def listening(registration_keys: RegistrationKeys) -> AsyncIterator[Listening]:
    registry = BackendRegistry(BreakerSettings())
    registry.add(BackendConfig(name="static", url="http://127.0.0.1:9", role=Role.CONSUMER))
    membership = Membership(registry, MembershipSettings(drain_grace_s=0))
    metrics = CollectorRegistry()
    settings = RegistrationSettings(
        endpoint="tcp://127.0.0.1:0",
        curve_secret_key_file=registration_keys.proxy_secret,
        curve_clients_dir=registration_keys.clients_dir,
        max_registrants=4,
        max_message_bytes=1024,
        max_messages_per_key_s=20,
        max_messages_per_s=1000,
        handshake_timeout_s=1.0,
    )
    listener = RegistrationListener(settings, membership, metrics_registry=metrics)
    await listener.start()
    assert listener.endpoint is not None
    try:
        yield Listening(
            listener, registry, membership, metrics, listener.endpoint, registration_keys
        )
    finally:
        await listener.close()


async def _closed_by_server(reader: asyncio.StreamReader) -> None:
    """Read until the server ends the connection (EOF or reset), within 10 s."""
    async with asyncio.timeout(10):
        try:
            while await reader.read(4096):
                pass
        except ConnectionResetError:
            pass


async def _admitted_worker_registers(ctx: Listening, port: int = 8100) -> None:
    worker = ctx.registrant(ctx.keys.worker_secret)
    try:
        await worker.send(vllm_message("P", port))
        await eventually(lambda: f"reg-127.0.0.1-{port}" in ctx.names(), 5)
    finally:
        worker.close()


@pytest.mark.parametrize("who", ["plain", "stranger"])
async def test_unauthenticated_senders_register_nothing(listening: Listening, who: str) -> None:
    ctx = listening
    secret = None if who == "plain" else ctx.keys.stranger_secret
    attacker = ctx.registrant(secret)
    try:
        for port in range(9000, 9010):
            await attacker.send(vllm_message("P", port))
        await attacker.send(vllm_message("P", 8100, leaving=True))
        await _admitted_worker_registers(ctx)  # the listener works meanwhile
        await asyncio.sleep(0.3)
        assert ctx.names() == {"static", "reg-127.0.0.1-8100"}
        assert sum(ctx.outcome(o) for o in ("joined", "refreshed", "left", "unknown")) == 1
        if who == "stranger":
            assert ctx.listener.refused_handshakes >= 1
        # The attacker cannot drain or replace what the admitted worker registered.
        await attacker.send(vllm_message("P", 8100, leaving=True))
        await attacker.send(vllm_message("P", 8100, zmq_port=1, name="reg-127.0.0.1-8100"))
        await asyncio.sleep(0.3)
        member = ctx.membership.get("reg-127.0.0.1-8100")
        assert member is not None and not member.draining
        assert member.backend.kv_address == ("127.0.0.1", 21001)
    finally:
        attacker.close()


async def test_oversized_message_is_dropped_before_decoding(listening: Listening) -> None:
    ctx = listening
    attacker = ctx.registrant(ctx.keys.worker_secret, identity="10.0.0.9:1")
    try:
        await attacker.send(b"\x81\xa4type\xa1P" + b"x" * 4096)  # past max_message_bytes
        await _admitted_worker_registers(ctx)
        assert ctx.outcome("malformed") == 0  # never reached the decoder
    finally:
        attacker.close()


async def test_garbage_tcp_gets_nothing(listening: Listening) -> None:
    ctx = listening
    host, port = ctx.endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\xff" * 4096)
    await writer.drain()
    await _closed_by_server(reader)  # libzmq closes a connection with a bad greeting
    writer.close()
    await _admitted_worker_registers(ctx)
    assert ctx.names() == {"static", "reg-127.0.0.1-8100"}


async def test_admitted_key_is_held_to_its_own_address_and_names(listening: Listening) -> None:
    ctx = listening
    worker = ctx.registrant(ctx.keys.worker_secret)
    try:
        await worker.send(vllm_message("D", 8100) | {"http_address": "10.9.9.9:8100"})
        await worker.send(vllm_message("D", 8100) | {"zmq_address": "10.9.9.9:1"})
        await worker.send(vllm_message("D", 8100, events_endpoint="tcp://10.9.9.9:5557"))
        await worker.send(vllm_message("D", 8100, events_endpoint="tcp://*:5557"))
        await worker.send(vllm_message("D", 8100) | {"http_address": "localhost:8100"})
        await worker.send(vllm_message("D", 8101, name="static"))  # a configured backend
        await worker.send(vllm_message("D", 8102, models="not-a-list"))
        await eventually(
            lambda: (
                ctx.outcome("address") == 4
                and ctx.outcome("malformed") == 2
                and ctx.outcome("conflict") == 1
            ),
            5,
        )
        assert ctx.names() == {"static"}
        static = ctx.registry.get("static")
        assert static is not None and static.url == "http://127.0.0.1:9"
    finally:
        worker.close()


async def test_a_consumer_keeps_its_announced_p2p_address_as_a_holder(
    listening: Listening,
) -> None:
    """Every worker is a P2P holder: a consumer's announced address is where a pull fetches
    from. It stays a consumer (never a producer candidate, so never a producer's address), and
    an address not its own is refused as for any role (the test above)."""
    ctx = listening
    worker = ctx.registrant(ctx.keys.worker_secret)
    try:
        await worker.send(vllm_message("D", 8100, zmq_port=21007))
        await eventually(lambda: "reg-127.0.0.1-8100" in ctx.names(), 5)
        member = ctx.membership.get("reg-127.0.0.1-8100")
        assert member is not None and member.backend.role is Role.CONSUMER
        assert member.backend.kv_address == ("127.0.0.1", 21007)
        assert "reg-127.0.0.1-8100" not in {b.name for b in ctx.registry.producers()}
    finally:
        worker.close()


async def test_another_admitted_key_cannot_drain_or_replace(
    listening: Listening, tmp_path: Path
) -> None:
    ctx = listening
    public, second_secret = write_certificate(tmp_path / "k2", "second")
    (ctx.keys.clients_dir / "second.key").write_text(public.read_text())
    await ctx.listener.close()  # reload the admitted keys
    await ctx.listener.start()
    assert ctx.listener.endpoint is not None
    ctx.endpoint = ctx.listener.endpoint
    await _admitted_worker_registers(ctx)
    other = ctx.registrant(second_secret, identity="10.0.0.2:1")
    try:
        await other.send(vllm_message("P", 8100, leaving=True))
        await other.send(vllm_message("P", 8100, zmq_port=1))
        await eventually(lambda: ctx.outcome("owner") == 2, 5)
        member = ctx.membership.get("reg-127.0.0.1-8100")
        assert member is not None and not member.draining
        assert member.backend.kv_address == ("127.0.0.1", 21001)
    finally:
        other.close()


async def test_registrant_cap_and_rates_bound_what_one_key_can_make_the_proxy_hold(
    listening: Listening,
) -> None:
    ctx = listening
    worker = ctx.registrant(ctx.keys.worker_secret)
    try:
        for port in range(8100, 8300):  # 200 distinct backends, as fast as it can
            await worker.send(vllm_message("D", port))
        await eventually(
            lambda: ctx.outcome("joined") + ctx.outcome("full") + ctx.outcome("rate") == 200, 10
        )
        assert ctx.outcome("joined") == 4  # max_registrants
        assert ctx.outcome("rate") >= 100  # 20 a second per key
        assert len(ctx.membership.members()) == 4 and len(ctx.registry.all()) == 5
    finally:
        worker.close()


def test_curve_is_required() -> None:
    with pytest.raises(ValueError, match="curve"):
        RegistrationSettings(endpoint="tcp://127.0.0.1:30001")


async def test_a_silent_connection_is_closed_after_the_handshake_timeout(
    listening: Listening,
) -> None:
    """A connection that never completes its handshake is closed by libzmq after
    ``handshake_timeout_s`` (1 s here), so idle sockets do not pile up."""
    host, port = listening.endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await _closed_by_server(reader)
    finally:
        writer.close()


async def test_a_squatter_on_the_victims_routing_id_cannot_keep_it_out(
    listening: Listening, tmp_path: Path
) -> None:
    """Finding 7: the ROUTER identified peers by the routing id they chose (vLLM's is its
    predictable ``zmq_address``): a second admitted key connected first under the victim's id
    and the victim never registered (20 heartbeats, no error)."""
    ctx = listening
    public, squatter_secret = write_certificate(tmp_path / "k2", "squatter")
    (ctx.keys.clients_dir / "squatter.key").write_text(public.read_text())
    await ctx.listener.close()  # reload the admitted keys
    await ctx.listener.start()
    assert ctx.listener.endpoint is not None
    ctx.endpoint = ctx.listener.endpoint
    squatter = ctx.registrant(squatter_secret, identity="10.0.0.1:21001")  # the victim's id
    victim: Registrant | None = None
    try:
        await squatter.send(vllm_message("P", 8200))
        await eventually(lambda: "reg-127.0.0.1-8200" in ctx.names(), 5)
        victim = ctx.registrant(ctx.keys.worker_secret, identity="10.0.0.1:21001")
        for _ in range(25):  # heartbeats, bounded
            await victim.send(vllm_message("P", 8100))
            if "reg-127.0.0.1-8100" in ctx.names():
                break
            await asyncio.sleep(0.2)
        assert "reg-127.0.0.1-8100" in ctx.names()
    finally:
        squatter.close()
        if victim is not None:
            victim.close()


async def test_a_revoked_key_is_out_without_a_restart(listening: Listening) -> None:
    """Finding 7: keys were read once at start. Deleting a worker's public key from
    ``curve_clients_dir`` now drains its backends and refuses its messages and new handshakes;
    putting the key back re-admits it."""
    ctx = listening
    name = "reg-127.0.0.1-8100"
    worker = ctx.registrant(ctx.keys.worker_secret)
    late: Registrant | None = None
    key_file = ctx.keys.clients_dir / "worker.key"
    try:
        await worker.send(vllm_message("P", 8100))
        await eventually(lambda: name in ctx.names(), 5)
        key_text = key_file.read_text()
        key_file.unlink()

        def drained() -> bool:
            member = ctx.membership.get(name)
            return member is None or member.draining

        await eventually(drained, 5)
        await worker.send(vllm_message("P", 8100))
        await eventually(lambda: ctx.outcome("revoked") >= 1, 5)
        assert drained()
        refused = ctx.listener.refused_handshakes
        late = ctx.registrant(ctx.keys.worker_secret, identity="10.0.0.3:1")
        await late.send(vllm_message("P", 8101))
        await eventually(lambda: ctx.listener.refused_handshakes > refused, 5)
        assert "reg-127.0.0.1-8101" not in ctx.names()
        key_file.write_text(key_text)  # re-enabled
        for _ in range(25):
            await worker.send(vllm_message("P", 8100))
            if not drained():
                break
            await asyncio.sleep(0.2)
        assert not drained()
    finally:
        worker.close()
        if late is not None:
            late.close()
