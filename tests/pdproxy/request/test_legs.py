"""Leg building rules, exhaustively, plus byte-faithfulness of everything else."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.errors import ClientRequestError, LegFailed
from pdproxy.front.intake import decode_body, has_long_digit_run
from pdproxy.request.legs import (
    PRODUCER_REMOVED_FIELDS,
    KvRequestId,
    consumer_body,
    consumer_kv_params,
    new_kv_request_id,
    producer_body,
    producer_kv_params,
)
from pdproxy.settings import Dialect

K = KvRequestId("00112233445566778899aabbccddeeff")
NIXL_PRODUCER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# The captured C1 body (shared/wire): floats, unknown fields, min_tokens.
C1 = (
    b'{"model": "fake-model", "prompt": "CASE-C1 the quick brown fox", "max_tokens": 8,'
    b' "min_tokens": 2, "temperature": 0.0, "top_p": 0.9, "top_k": 5,'
    b' "repetition_penalty": 1.1, "seed": 7, "stop": ["\\n\\n"], "cache_salt": "salt-1",'
    b' "priority": 0, "user": "u1", "custom_unknown_field": "keep-me?"}'
)


def producer_leg(raw: bytes, dialect: Dialect = Dialect.NIXL) -> dict[str, Any]:
    out: dict[str, Any] = orjson.loads(
        producer_body(decode_body(raw), producer_kv_params(dialect, K))
    )
    return out


def test_producer_leg_rules_on_captured_body() -> None:
    leg = producer_leg(C1)
    client = orjson.loads(C1)
    expected = dict(client)
    expected.update(max_tokens=1, stream=False, kv_transfer_params=NIXL_PRODUCER)
    del expected["min_tokens"]
    assert leg == expected


def test_producer_leg_top_p_is_not_rounded_through_f32() -> None:
    raw = producer_body(decode_body(C1), producer_kv_params(Dialect.NIXL, K))
    assert b'"top_p":0.9,' in raw
    assert b'"repetition_penalty":1.1,' in raw
    assert b"0.8999999761581421" not in raw
    assert orjson.loads(raw)["top_p"] == 0.9


@pytest.mark.parametrize(
    ("client", "expected_changes"),
    [
        ({}, {"max_tokens": 1, "stream": False}),
        ({"max_tokens": 50}, {"max_tokens": 1, "stream": False}),
        ({"stream": True}, {"max_tokens": 1, "stream": False}),
        (
            {"max_completion_tokens": 9},
            {"max_tokens": 1, "max_completion_tokens": 1, "stream": False},
        ),
        (
            {"max_tokens": 7, "max_completion_tokens": 6},
            {"max_tokens": 1, "max_completion_tokens": 1, "stream": False},
        ),
    ],
)
def test_producer_leg_max_tokens_and_stream(
    client: dict[str, Any], expected_changes: dict[str, Any]
) -> None:
    client = {"model": "m", "prompt": "p", **client}
    leg = producer_leg(orjson.dumps(client))
    assert leg == {**client, **expected_changes, "kv_transfer_params": NIXL_PRODUCER}


@pytest.mark.parametrize("field", PRODUCER_REMOVED_FIELDS)
def test_producer_leg_removes_stream_and_min_fields(field: str) -> None:
    value: Any = {"include_usage": True, "continuous_usage_stats": True}
    value = value if field == "stream_options" else 3
    leg = producer_leg(orjson.dumps({"model": "m", "prompt": "p", field: value}))
    assert field not in leg


def test_producer_leg_p2p_params() -> None:
    leg = producer_leg(b'{"model":"m","prompt":"p"}', Dialect.P2P)
    assert leg["kv_transfer_params"] == {"remote_decoder": {"kv_request_id": K}}


def test_none_dialect_has_no_producer_leg() -> None:
    with pytest.raises(ValueError, match="no producer leg"):
        producer_kv_params(Dialect.NONE, K)


def test_consumer_leg_is_the_client_body_with_only_kv_params_set() -> None:
    body = decode_body(C1)
    kvp = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "future_key": {"x": 1.5}}
    leg = orjson.loads(consumer_body(body, kvp))
    assert leg == {**orjson.loads(C1), "kv_transfer_params": kvp}


def test_consumer_leg_without_params_is_the_raw_bytes() -> None:
    body = decode_body(C1)
    assert consumer_body(body, None) is C1


def test_stream_options_survive_on_consumer_leg() -> None:
    raw = (
        b'{"model":"m","stream":true,'
        b'"stream_options":{"include_usage":true,"continuous_usage_stats":true}}'
    )
    leg = orjson.loads(consumer_body(decode_body(raw), {"a": 1}))
    assert leg["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert leg["stream"] is True


def test_big_integers_are_not_turned_into_floats() -> None:
    raw = (
        b'{"model":"m","seed":123456789012345678901234567890,'
        b'"logit_bias":{"1":0.30000000000000004}}'
    )
    leg = producer_body(decode_body(raw), producer_kv_params(Dialect.NIXL, K))
    assert b'"seed":123456789012345678901234567890' in leg
    assert b"0.30000000000000004" in leg
    assert json.loads(leg)["seed"] == 123456789012345678901234567890


@pytest.mark.parametrize(
    "number", [-9223372036854775809, -(10**19) + 1, 2**64, 2**64 - 1, -(2**63)]
)
def test_integers_at_the_64_bit_edges_survive(number: int) -> None:
    raw = b'{"model":"m","seed":%d}' % number
    leg = consumer_body(decode_body(raw), {"k": 1})
    assert json.loads(leg)["seed"] == number
    assert b'"seed":%d' % number in leg


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[1,2]",
        b'"text"',
        b"{bad json",
        b'{"a": NaN}',
        b'{"seed": 123456789012345678901, "x": NaN}',
    ],
)
def test_non_object_or_invalid_bodies_are_400(raw: bytes) -> None:
    with pytest.raises(ClientRequestError) as info:
        decode_body(raw)
    assert info.value.status == 400


def test_unicode_survives() -> None:
    raw = '{"model":"m","prompt":"héllo \\u00e9 ☃ 𝄞"}'.encode()
    leg = orjson.loads(consumer_body(decode_body(raw), {"k": 1}))
    assert leg["prompt"] == "héllo é ☃ 𝄞"


# ---------------------------------------------------------------- consumer kv params


def test_nixl_consumer_params_are_the_producers_object_verbatim() -> None:
    kvp = {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "e",
        "new_engine_key": [0.1, None, {"z": True}],
    }
    answer = orjson.dumps({"id": "x", "kv_transfer_params": kvp})
    assert consumer_kv_params(Dialect.NIXL, "P", answer, K) == kvp


def test_p2p_consumer_params_build_remote_prefiller() -> None:
    answer = orjson.dumps(
        {
            "kv_transfer_params": {
                "remote_host": "10.0.0.5",
                "remote_port": 7001,
                "kv_request_id": K,
                "num_blocks": 3,
            }
        }
    )
    assert consumer_kv_params(Dialect.P2P, "P", answer, K) == {
        "remote_prefiller": {"kv_request_id": K, "remote_host": "10.0.0.5", "remote_port": 7001}
    }


def test_p2p_consumer_params_carry_the_producers_node_id() -> None:
    """The consumer pins its P2P handshake to this node id (a relay is refused)."""
    kvp = {"remote_host": "h", "remote_port": 7001, "kv_request_id": K, "remote_engine_id": "p-1"}
    answer = orjson.dumps({"kv_transfer_params": kvp})
    assert consumer_kv_params(Dialect.P2P, "P", answer, K)["remote_prefiller"] == {
        "kv_request_id": K,
        "remote_host": "h",
        "remote_port": 7001,
        "remote_engine_id": "p-1",
    }


@pytest.mark.parametrize("engine_id", ["", 7, ["p"], "x" * 257])
def test_p2p_unusable_node_id_fails_the_leg(engine_id: object) -> None:
    kvp = {"remote_host": "h", "remote_port": 1, "kv_request_id": K, "remote_engine_id": engine_id}
    with pytest.raises(LegFailed):
        consumer_kv_params(Dialect.P2P, "P", orjson.dumps({"kv_transfer_params": kvp}), K)


@pytest.mark.parametrize(
    "answer",
    [
        b"not json",
        b"[]",
        b'{"kv_transfer_params": null}',
        b'{"kv_transfer_params": {"remote_host": "h"}}',
        b'{"kv_transfer_params": {"remote_host": "h", "remote_port": "7"}}',
        b'{"kv_transfer_params": {"remote_host": "h", "remote_port": 7, "kv_request_id": "other"}}',
    ],
)
def test_p2p_bad_producer_answers_fail_the_leg(answer: bytes) -> None:
    with pytest.raises(LegFailed):
        consumer_kv_params(Dialect.P2P, "P", answer, K)


def test_nixl_answer_without_params_fails_the_leg() -> None:
    with pytest.raises(LegFailed):
        consumer_kv_params(Dialect.NIXL, "P", b'{"id": "x"}', K)


def test_kv_request_ids_are_fresh_128_bit() -> None:
    ids = {new_kv_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


# ---------------------------------------------------------------- properties

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=10,
)
TOUCHED = {
    "stream",
    "max_tokens",
    "max_completion_tokens",
    "kv_transfer_params",
    *PRODUCER_REMOVED_FIELDS,
}


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.text(max_size=12), json_values, max_size=8),
    st.sampled_from([Dialect.NIXL, Dialect.P2P]),
)
def test_untouched_fields_survive_exactly(client: dict[str, Any], dialect: Dialect) -> None:
    raw = json.dumps(client).encode()
    body = decode_body(raw)
    prod = json.loads(producer_body(body, producer_kv_params(dialect, K)))
    cons = json.loads(consumer_body(body, {"x": 1}))
    for key, value in client.items():
        if key not in TOUCHED:
            assert prod[key] == value and type(prod[key]) is type(value)
            assert cons[key] == value and type(cons[key]) is type(value)
    assert set(prod) - set(client) <= TOUCHED
    assert set(cons) - set(client) == ({"kv_transfer_params"} - set(client))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"prompt": "\\ud800", "max_tokens": 2, "n": 10000000000000000000000}',
    ],
)
def test_lone_surrogates_are_refused_whichever_codec_decodes(raw: bytes) -> None:
    with pytest.raises(ClientRequestError) as info:
        decode_body(raw)
    assert info.value.status == 400


@given(st.binary(max_size=200))
def test_long_digit_runs_are_found_like_the_regex(raw: bytes) -> None:
    for probe in (raw, raw + b"1" * 19, b"9" * 18 + raw):
        assert has_long_digit_run(probe) == (re.search(rb"\d{19,}", probe) is not None)


# ---------------------------------------------------------------- the consumer leg's bytes


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","prompt":"p"}',
        b'{ "model" : "m", "prompt" : "p" }\n\t ',
        b"{}",
        b' {"a":{"b":[1,2,{"c":"}"}]}} ',
        b'{"prompt":"\\u00e9 \\" }","seed":123456789012345678901234567890}',
    ],
)
def test_consumer_leg_is_the_clients_bytes_with_the_params_spliced_in(raw: bytes) -> None:
    kvp = {"remote_prefiller": {"kv_request_id": "k", "remote_host": "h", "remote_port": 1}}
    leg = consumer_body(decode_body(raw), kvp)
    assert leg.startswith(raw.rstrip()[:-1])  # every byte the client sent, untouched
    assert json.loads(leg) == {**json.loads(raw), "kv_transfer_params": kvp}


def test_a_body_with_a_bom_is_re_encoded_not_spliced() -> None:
    raw = b'\xef\xbb\xbf{"model":"m","seed":123456789012345678901234567890}'
    leg = consumer_body(decode_body(raw), {"k": 1})
    assert not leg.startswith(b"\xef")
    assert json.loads(leg) == {
        "model": "m",
        "seed": 123456789012345678901234567890,
        "kv_transfer_params": {"k": 1},
    }
