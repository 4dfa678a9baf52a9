"""What the reference worker announces, and the settings that switch it on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.announce import decode, encode
from kvtier.events.curve import load_client, write_certificate
from kvtier.worker.announce import Announcer, worker_announcement
from kvtier.worker.settings import WorkerSettings
from tests.conftest import free_port


def test_announcement_of_a_producer_on_all_interfaces() -> None:
    settings = WorkerSettings(
        role="producer", model="sim", host="0.0.0.0", advertise_host="10.0.0.7", port=8100,
        events_endpoint="tcp://*:5557", events_replay_endpoint="tcp://10.0.0.7:5558",
        announce_name="prefill-7",
    )  # fmt: skip
    ann = worker_announcement(settings, p2p_port=5600)
    assert (ann.kind, ann.http_address, ann.zmq_address) == ("P", "10.0.0.7:8100", "10.0.0.7:5600")
    assert ann.events_endpoint == "tcp://10.0.0.7:5557"  # a wildcard bind, as others reach it
    assert ann.events_replay_endpoint == "tcp://10.0.0.7:5558"
    assert (ann.name, ann.models, ann.dialect) == ("prefill-7", ("kvtier-sim",), "p2p")
    assert decode(encode(ann)) == ann


def test_consumer_on_ipv6_without_p2p_server() -> None:
    settings = WorkerSettings(role="consumer", model="sim", host="::1", port=8200)
    ann = worker_announcement(settings, p2p_port=0)
    assert (ann.kind, ann.http_address, ann.zmq_address) == ("D", "[::1]:8200", None)
    assert decode(encode(ann)).hosts() == ["::1"]


def test_announcing_needs_both_key_files(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="announce_curve"):
        WorkerSettings(announce_endpoint="tcp://127.0.0.1:30001")
    public, secret = write_certificate(tmp_path, "w")
    settings = WorkerSettings(
        announce_endpoint="tcp://127.0.0.1:30001",
        announce_curve_secret_key_file=secret,
        announce_curve_server_key_file=public,
    )
    assert Announcer.from_settings(settings, 0) is not None
    assert Announcer.from_settings(WorkerSettings(), 0) is None


def _announcer(tmp_path: Path, listening: tuple[str, int] | None) -> Announcer:
    public, secret = write_certificate(tmp_path, "w")
    announcement = worker_announcement(WorkerSettings(model="sim"), 0)
    keys = load_client(secret, public)
    return Announcer("tcp://127.0.0.1:9", announcement, keys, 0.01, listening=listening)


async def test_announcer_never_blocks_without_a_proxy(tmp_path: Path) -> None:
    """No proxy listening: heartbeats are dropped, not queued; leave and close return."""
    announcer = _announcer(tmp_path, None)
    announcer.start()
    await asyncio.sleep(0.2)
    await announcer.close()
    assert announcer.sent == 0 and announcer.dropped >= 2  # nothing queued for nobody


async def test_first_announcement_waits_for_the_http_port(tmp_path: Path) -> None:
    port = free_port()
    announcer = _announcer(tmp_path, ("127.0.0.1", port))
    announcer.start()
    try:
        await asyncio.sleep(0.3)
        assert announcer.sent + announcer.dropped == 0  # the port is not open yet
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        async with server:
            async with asyncio.timeout(10):
                while announcer.dropped == 0:  # now it tries (no proxy: dropped)
                    await asyncio.sleep(0.02)
    finally:
        await announcer.close()
