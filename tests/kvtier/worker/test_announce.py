"""What the reference worker announces, and the settings that switch it on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.announce import decode, encode
from kvtier.events.curve import write_certificate
from kvtier.worker.announce import Announcer, worker_announcement
from kvtier.worker.settings import WorkerSettings


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


async def test_announcer_never_blocks_without_a_proxy(tmp_path: Path) -> None:
    """No proxy listening: heartbeats are dropped or queued (bounded), leave and close return."""
    public, secret = write_certificate(tmp_path, "w")
    settings = WorkerSettings(
        model="sim", announce_endpoint="tcp://127.0.0.1:9", announce_interval_s=0.01,
        announce_curve_secret_key_file=secret, announce_curve_server_key_file=public,
    )  # fmt: skip
    announcer = Announcer.from_settings(settings, 0)
    assert announcer is not None
    announcer.start()
    await asyncio.sleep(0.2)
    await announcer.close()
    assert announcer.sent == 0 and announcer.dropped >= 2  # nothing queued for nobody
