"""``p2p_allowed_peers``: a hostile client points a consumer leg at an address of its choosing."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.worker.kv_params import parse_leg
from kvtier.worker.peers import PeerAllowlist
from kvtier.worker.settings import WorkerSettings

from .conftest import running_worker, small_settings

PROMPT = "The consumer would fetch this prompt's KV from the producer it is told about. " * 2

LOOPBACK_ONLY = PeerAllowlist.parse([])


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "[::1]",
        "localhost",
        "LOCALHOST",
        "localhost.",
        "::ffff:127.0.0.1",
    ],
)
def test_default_allows_loopback(host: str) -> None:
    assert LOOPBACK_ONLY.allows(host, 5600)


@pytest.mark.parametrize(
    "host",
    [
        "10.0.0.5",
        "169.254.169.254",
        "0.0.0.0",
        "::",
        "evil.example",
        "localhost.evil.example",
        "127.0.0.1.nip.io",
        "127.1",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "::ffff:10.0.0.1",
        "",
        " ",
        "[::1",
        "fe80::1%lo",
    ],
)
def test_default_refuses_everything_else(host: str) -> None:
    """Spellings the OS resolver would map to loopback (``127.1``) are host names here and match
    no entry: refused, so no resolver quirk widens the list."""
    assert not LOOPBACK_ONLY.allows(host, 5600)


def test_entries_hosts_ports_networks() -> None:
    peers = PeerAllowlist.parse(
        ["producer-0", "producer-1:5600", "10.1.0.0/16", "10.2.0.7:5601", "[fd00::/8]:5600"]
    )
    assert peers.allows("producer-0", 1) and peers.allows("Producer-0.", 5600)
    assert peers.allows("producer-1", 5600) and not peers.allows("producer-1", 5601)
    assert peers.allows("10.1.200.3", 9) and not peers.allows("10.3.0.1", 9)
    assert peers.allows("10.2.0.7", 5601) and not peers.allows("10.2.0.7", 5600)
    assert peers.allows("fd12::1", 5600) and not peers.allows("fd12::1", 22)
    assert not peers.allows("127.0.0.1", 5600)  # an explicit list replaces the default
    assert not peers.allows("producer-2", 5600)
    assert PeerAllowlist.parse(["*"]).allows("anything.at.all", 1)


@pytest.mark.parametrize(
    "entry", ["", ":5600", "host:0", "host:99999", "host:port", "[::1", "[::1]5600", "10.0.0.0/33"]
)
def test_bad_entries_fail_at_start(entry: str) -> None:
    with pytest.raises(ValueError, match="p2p_allowed_peers"):
        WorkerSettings(p2p_allowed_peers=[entry])


@pytest.mark.parametrize(
    ("params", "peer"),
    [
        ({"remote_prefiller": {"kv_request_id": "k", "remote_host": "10.9.8.7", "remote_port": 1}},
         "producer 10.9.8.7:1"),
        ({"do_remote_prefill": True, "remote_request_id": "k", "remote_host": "10.9.8.7",
          "remote_port": 1}, "producer 10.9.8.7:1"),
        ({"remote_kv_source": {"remote_host": "10.9.8.7", "remote_port": 1}},
         "remote_kv_source 10.9.8.7:1"),
        ({"remote_decoder": {"kv_request_id": "k"},
          "remote_kv_source": {"remote_host": "10.9.8.7", "remote_port": 1}},
         "remote_kv_source 10.9.8.7:1"),
    ],
)  # fmt: skip
def test_every_leg_naming_a_peer_is_checked(params: dict[str, Any], peer: str) -> None:
    """The one check the worker and vLLM's connector both run: every leg that would make this
    node connect somewhere, in either dialect (issue 30: vLLM checked ``remote_kv_source``
    only)."""
    leg = parse_leg(params, "nixl-id")
    assert str(LOOPBACK_ONLY.refused(leg)) == peer
    assert PeerAllowlist.parse(["10.0.0.0/8"]).refused(leg) is None


def test_legs_naming_no_peer_are_never_refused() -> None:
    for params in ({"remote_decoder": {"kv_request_id": "k"}}, {"do_remote_decode": True}, None):
        assert LOOPBACK_ONLY.refused(parse_leg(params, "nixl-id")) is None


_ADDRESSES = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))


@given(_ADDRESSES, st.integers(1, 65535))
def test_a_network_entry_admits_exactly_its_addresses(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int
) -> None:
    net = ipaddress.ip_network("10.0.0.0/8")
    peers = PeerAllowlist.parse(["10.0.0.0/8"])
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    inside = address in net or (mapped is not None and mapped in net)
    assert peers.allows(str(address), port) is inside


@given(st.text(max_size=40), st.integers(1, 65535))
def test_no_text_passes_the_default_unless_it_is_loopback(host: str, port: int) -> None:
    if LOOPBACK_ONLY.allows(host, port):
        name = host.strip().lower().strip("[]").rstrip(".")
        if name != "localhost":
            address = ipaddress.ip_address(name)
            mapped = getattr(address, "ipv4_mapped", None)
            assert (mapped or address).is_loopback


class _Attacker:
    """A TCP listener standing for an attacker's fake producer: counts who connects."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> _Attacker:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            writer.close()

        self.server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


def _consumer_params(dialect: str, host: str, port: int) -> dict[str, Any]:
    if dialect == "p2p":
        return {
            "remote_prefiller": {"kv_request_id": "k1", "remote_host": host, "remote_port": port}
        }
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e",
        "remote_request_id": "k1",
        "remote_block_ids": [0, 1],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    }


@pytest.mark.parametrize("dialect", ["p2p", "nixl"])
async def test_a_consumer_pointed_at_an_attacker_is_refused_and_never_connects(
    dialect: str,
) -> None:
    settings = small_settings(model="sim", p2p_allowed_peers=["producer-0:5600", "10.9.0.0/16"])
    async with _Attacker() as attacker, running_worker(settings) as w:
        body = {
            "prompt": PROMPT,
            "max_tokens": 2,
            "kv_transfer_params": _consumer_params(dialect, "127.0.0.1", attacker.port),
        }
        resp = await w.client.post("/v1/completions", json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert "p2p_allowed_peers" in error["message"] and error["param"] == "kv_transfer_params"
        assert w.worker.stats.kv_params_refused == 1
        assert w.worker.stats.prompt_tokens == 0  # refused, not run locally
        metrics = (await w.client.get("/metrics")).text
        assert "kvtier_worker_kv_params_refused_total 1.0" in metrics
        await asyncio.sleep(0.05)
        assert attacker.connections == 0


async def test_a_default_consumer_refuses_a_remote_producer() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        body = {
            "prompt": PROMPT,
            "max_tokens": 2,
            "kv_transfer_params": _consumer_params("p2p", "169.254.169.254", 80),
        }
        resp = await w.client.post("/v1/completions", json=body)
        assert resp.status_code == 400 and w.worker.stats.kv_params_refused == 1


async def test_an_allowed_producer_is_still_tried() -> None:
    """Positive control: an allowed but absent producer is a fetch failure (recompute), not a
    refusal, so the refusals above come from the allowlist and nothing else."""
    async with _Attacker() as producer:
        settings = small_settings(
            model="sim", fetch_timeout_s=1.0, p2p_allowed_peers=[f"127.0.0.1:{producer.port}"]
        )
        async with running_worker(settings) as w:
            body = {
                "prompt": PROMPT,
                "max_tokens": 2,
                "kv_transfer_params": _consumer_params("p2p", "127.0.0.1", producer.port),
            }
            resp = await w.client.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert w.worker.stats.kv_params_refused == 0
            assert producer.connections >= 1
