"""Data-parallel ranks in announcements: ``dp_size`` (the key vLLM's MoRIIO connector sends)
round-trips, is bounded, and makes the proxy's backend a ranked one; a hostile value is a
typed error (the registration listener counts it as malformed)."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.announce import MAX_DP_SIZE, Announcement, decode, encode
from kvtier.errors import AnnouncementError
from kvtier.worker.announce import worker_announcement
from kvtier.worker.settings import WorkerSettings
from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.membership.members import Membership
from pdproxy.fleet.membership.registration import RegistrationListener
from pdproxy.settings import BreakerSettings
from pdproxy.settings.membership import MembershipSettings, RegistrationSettings


def message(**extra: object) -> bytes:
    base = {"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:5600"}
    return bytes(msgpack.dumps({**base, **extra}))


def test_dp_size_round_trips_and_defaults_to_one() -> None:
    assert decode(message()).dp_size == 1
    ann = Announcement(kind="PD", http_address="10.0.0.5:8100", zmq_address="10.0.0.5:5600",
                       dp_size=4)  # fmt: skip
    assert decode(encode(ann)) == ann
    assert "dp_size" not in msgpack.loads(encode(Announcement("D", "10.0.0.5:8100")))


@pytest.mark.parametrize(
    "extra",
    [
        {"dp_size": 0},
        {"dp_size": -1},
        {"dp_size": MAX_DP_SIZE + 1},
        {"dp_size": True},
        {"dp_size": "2"},
        {"dp_size": 2**63},
        {"dp_size": 2, "zmq_address": "127.0.0.1:65535"},
        {"dp_size": 3, "events_endpoint": "tcp://127.0.0.1:65534"},
    ],
)
def test_hostile_dp_sizes_are_typed_errors(extra: dict[str, object]) -> None:
    with pytest.raises(AnnouncementError):
        decode(message(**extra))


def test_a_worker_announces_its_ranks() -> None:
    settings = WorkerSettings(model="sim", data_parallel_size=3)
    assert worker_announcement(settings, 5600).dp_size == 3


def test_registration_makes_a_ranked_backend_and_counts_a_bad_one_as_malformed() -> None:
    registry = BackendRegistry(BreakerSettings())
    membership = Membership(registry, MembershipSettings())
    listener = RegistrationListener(RegistrationSettings(), membership)
    assert listener.accept(message(dp_size=2, name="w"), "a" * 40, "127.0.0.1") == "joined"
    backend = registry.get("w")
    assert backend is not None and backend.data_parallel_size == 2
    assert listener.accept(message(dp_size=999, name="v"), "a" * 40, "127.0.0.1") == "malformed"
    assert registry.get("v") is None
