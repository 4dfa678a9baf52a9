"""The producer-leg policy table (DESIGN §4)."""

from __future__ import annotations

import pytest

from kvtier.offload import OffloadPolicy, producer_kv_request_id, producer_leg_policy

RL, BL = OffloadPolicy.REQUEST_LEVEL, OffloadPolicy.BLOCK_LEVEL

POLICY_TABLE: list[tuple[str, dict[str, object] | None, OffloadPolicy]] = [
    ("producer leg with kv_request_id", {"remote_decoder": {"kv_request_id": "abc"}}, RL),
    ("plain request", None, BL),
    ("plain request, empty params", {}, BL),
    (
        "consumer leg",
        {"remote_prefiller": {"kv_request_id": "abc", "remote_host": "h", "remote_port": 1}},
        BL,
    ),
    ("remote_decoder without kv_request_id", {"remote_decoder": {}}, BL),
    ("remote_decoder with empty kv_request_id", {"remote_decoder": {"kv_request_id": ""}}, BL),
    ("remote_decoder with blank kv_request_id", {"remote_decoder": {"kv_request_id": "  "}}, BL),
    ("remote_decoder with non-string id", {"remote_decoder": {"kv_request_id": 7}}, BL),
    ("remote_decoder not an object", {"remote_decoder": "abc"}, BL),
    ("NIXL producer leg (no kv_request_id)", {"do_remote_decode": True, "remote_host": None}, BL),
]


@pytest.mark.parametrize(
    ("case", "params", "policy"), POLICY_TABLE, ids=[c for c, _, _ in POLICY_TABLE]
)
def test_policy_table(case: str, params: dict[str, object] | None, policy: OffloadPolicy) -> None:
    assert producer_leg_policy(params) is policy
    assert (producer_kv_request_id(params) is not None) == (policy is RL)


def test_producer_id_is_returned() -> None:
    assert producer_kv_request_id({"remote_decoder": {"kv_request_id": "k-42"}}) == "k-42"
