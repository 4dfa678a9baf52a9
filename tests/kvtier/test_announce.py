"""The announcement wire format: vLLM's registration message, kvtier's optional keys, and
what a hostile sender's bytes do to the decoder (a typed error, bounded work)."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.announce import MAX_MESSAGE_BYTES, Announcement, decode, encode
from kvtier.errors import AnnouncementError


def test_vllm_p2p_nccl_message_decodes() -> None:
    """``P2pNcclEngine.ping`` sends exactly these three keys, msgpack-packed."""
    payload = msgpack.dumps(
        {"type": "P", "http_address": "10.0.0.5:8100", "zmq_address": "10.0.0.5:21001"}
    )
    ann = decode(payload)
    assert ann == Announcement(kind="P", http_address="10.0.0.5:8100", zmq_address="10.0.0.5:21001")
    decode_side = decode(
        msgpack.dumps({"type": "D", "http_address": "[::1]:8200", "zmq_address": "[::1]:22001"})
    )
    assert decode_side.kind == "D" and decode_side.hosts() == ["::1", "::1"]


def test_vllm_moriio_message_decodes() -> None:
    """vLLM's MoRIIO connector heartbeat: extra keys (ignored) and a zmq_address that packs
    several ports (opaque: never a KV address, never connected to)."""
    payload = msgpack.dumps(
        {
            "type": "D",
            "http_address": "10.0.0.5:8200",
            "zmq_address": "host:10.0.0.5,handshake:6301,notify:6401",
            "dp_size": 1,
            "tp_size": 2,
            "transfer_mode": "READ",
        }
    )
    ann = decode(payload)
    assert (ann.kind, ann.http_address, ann.kv_address) == ("D", "10.0.0.5:8200", None)
    assert ann.hosts() == ["10.0.0.5"]
    with pytest.raises(AnnouncementError):  # past MAX_KEYS
        decode(msgpack.dumps({f"k{i}": i for i in range(17)} | {"type": "P"}))


def test_vllm_proxy_reads_kvtier_messages() -> None:
    """vLLM's example proxy reads ``type``, ``http_address`` and ``zmq_address`` from our
    message; the extra keys are ignored there."""
    ann = Announcement(
        kind="P", http_address="10.0.0.5:8100", zmq_address="10.0.0.5:5600",
        models=("m",), dialect="p2p", events_endpoint="tcp://10.0.0.5:5557",
    )  # fmt: skip
    data = msgpack.loads(encode(ann))
    assert (data["type"], data["http_address"], data["zmq_address"]) == (
        "P", "10.0.0.5:8100", "10.0.0.5:5600",
    )  # fmt: skip


_host = st.sampled_from(["127.0.0.1", "10.1.2.3", "[::1]", "[fd00::5]", "worker-3.svc"])
_port = st.integers(1, 65535)
_address = st.builds(lambda h, p: f"{h}:{p}", _host, _port)
_name = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["P", "D", "PD"]),
    http=_address,
    zmq=st.none() | _address,
    name=st.none() | _name,
    models=st.lists(_name, max_size=5, unique=True).map(tuple),
    events=st.none() | _address.map(lambda a: f"tcp://{a}"),
    leaving=st.booleans(),
)
def test_roundtrip(
    kind: str, http: str, zmq: str | None, name: str | None, models: tuple[str, ...],
    events: str | None, leaving: bool,
) -> None:  # fmt: skip
    ann = Announcement(
        kind=kind,  # type: ignore[arg-type]
        http_address=http, zmq_address=zmq, name=name, models=models,
        dialect="nixl", events_endpoint=events, leaving=leaving,
    )  # fmt: skip
    assert decode(encode(ann)) == ann


@pytest.mark.parametrize(
    "data",
    [
        {"type": "X", "http_address": "1.2.3.4:80"},
        {"type": "P"},
        {"type": "P", "http_address": "1.2.3.4"},
        {"type": "P", "http_address": "1.2.3.4:0"},
        {"type": "P", "http_address": "1.2.3.4:99999"},
        {"type": "P", "http_address": "user@evil:80"},
        {"type": "P", "http_address": 5},
        {"type": "P", "http_address": "1.2.3.4:80", "events_endpoint": "tcp://*:5557"},
        {"type": "P", "http_address": "1.2.3.4:80", "events_endpoint": "ipc:///tmp/x"},
        {"type": "P", "http_address": "1.2.3.4:80", "name": "../../etc"},
        {"type": "P", "http_address": "1.2.3.4:80", "models": "m"},
        {"type": "P", "http_address": "1.2.3.4:80", "models": ["m"] * 33},
        {"type": "P", "http_address": "1.2.3.4:80", "leaving": "yes"},
        {"type": "P", "http_address": "1.2.3.4:80", "dialect": "grpc"},
        {"type": "P", "http_address": "1.2.3.4:80", "name": "x" * 300},
    ],
)
def test_malformed_messages_are_typed_errors(data: dict[str, object]) -> None:
    with pytest.raises(AnnouncementError):
        decode(msgpack.dumps(data))


def test_size_and_shape_bounds() -> None:
    with pytest.raises(AnnouncementError):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    with pytest.raises(AnnouncementError):
        decode(msgpack.dumps([1, 2, 3]))
    with pytest.raises(AnnouncementError):
        decode(b"\xc1")  # never used in msgpack
    with pytest.raises(AnnouncementError):  # a 2**32-element array header: refused, not allocated
        decode(b"\x81\xa6models\xdd\xff\xff\xff\xff")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_or_raise_the_typed_error(payload: bytes) -> None:
    with contextlib.suppress(AnnouncementError):
        decode(payload)
