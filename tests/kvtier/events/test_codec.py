"""Codec: round trips, and batches encoded the way vLLM's msgspec structs encode them."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import EventDecodeError
from kvtier.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventEncoding,
    Medium,
    decode_batch,
    encode_batch,
    event_medium,
)

hashes = st.lists(
    st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=16, max_size=32)), max_size=4
)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=48)
opt_str = st.none() | st.sampled_from(["GPU", "CPU"])
stored = st.builds(
    BlockStored,
    block_hashes=hashes.map(tuple),
    parent_block_hash=st.none() | st.integers(0, 2**64 - 1),
    token_ids=tokens.map(tuple),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 10),
    medium=opt_str,
    lora_name=st.none() | st.text(max_size=5),
    group_idx=st.none() | st.integers(0, 3),
    kv_cache_spec_kind=st.none() | st.just("full_attention"),
    kv_cache_spec_sliding_window=st.none() | st.integers(1, 4096),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=hashes.map(tuple),
    medium=opt_str,
    group_idx=st.none() | st.integers(0, 3),
)
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6)
batches = st.builds(
    EventBatch,
    ts=st.floats(0, 2e9, allow_nan=False),
    events=events.map(tuple),
    data_parallel_rank=st.none() | st.integers(0, 7),
)


@given(batches, st.sampled_from(list(EventEncoding)))
def test_round_trip(batch: EventBatch, encoding: EventEncoding) -> None:
    assert decode_batch(encode_batch(batch, encoding)) == batch


def test_array_layout_is_vllms() -> None:
    """Positional fields in vLLM's order, every one written (msgspec array_like does so)."""
    batch = EventBatch(
        ts=1.5,
        events=(
            BlockStored((11, 12), None, tuple(range(32)), 16, None, "CPU"),
            BlockRemoved((11,), "GPU"),
            AllBlocksCleared(),
        ),
    )
    raw = msgpack.unpackb(encode_batch(batch), raw=False)
    assert raw == [
        1.5,
        [
            ["BlockStored", [11, 12], None, list(range(32)), 16, None, "CPU"] + [None] * 5,
            ["BlockRemoved", [11], "GPU", None],
            ["AllBlocksCleared"],
        ],
        None,
    ]


def test_map_layout_is_vllms() -> None:
    batch = EventBatch(
        ts=2.0,
        events=(BlockStored((7,), 6, (1, 2), 2, None, "GPU", group_idx=0),),
        data_parallel_rank=0,
    )
    raw = msgpack.unpackb(encode_batch(batch, EventEncoding.MAP), raw=False)
    assert raw == [
        2.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7],
                "parent_block_hash": 6,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            }
        ],
        0,
    ]


def test_decodes_older_engines() -> None:
    """vLLM 0.9 sent five BlockStored fields and one BlockRemoved field, and no rank."""
    payload = msgpack.packb(
        [3.0, [["BlockStored", [1, 2], None, [5] * 32, 16, None], ["BlockRemoved", [2]]]]
    )
    batch = decode_batch(payload)
    assert batch.events == (
        BlockStored((1, 2), None, (5,) * 32, 16, None, None),
        BlockRemoved((2,), None),
    )
    assert [
        event_medium(e.medium) for e in batch.events if not isinstance(e, AllBlocksCleared)
    ] == [
        Medium.GPU,
        Medium.GPU,
    ]


CAPTURED_TOKENS = [151644, 872, 198, 9064, 374, 279, 6722, 315, 5616, 30, 151645, 198]
CAPTURED_TOKENS += [151644, 77091, 198, 151667]


def test_decodes_vllm_026_capture() -> None:
    """A batch as printed from a vLLM 0.26 engine (map events, array batch, u64 hashes)."""
    payload = msgpack.packb(
        [
            1789095808.8378847,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [15760518052499183552],
                    "parent_block_hash": None,
                    "token_ids": CAPTURED_TOKENS,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                    "some_future_field": 1,
                }
            ],
            0,
        ]
    )
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (15760518052499183552,)
    assert event.extra_keys == (None,)
    assert event.kv_cache_spec_kind == "full_attention"


def test_unknown_event_tags_are_skipped() -> None:
    payload = msgpack.packb([1.0, [["BlockTouched", [1]], ["BlockRemoved", [1], "CPU"]]])
    assert decode_batch(payload).events == (BlockRemoved((1,), "CPU"),)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # reserved msgpack byte
        b"",
        msgpack.packb({"not": "a batch"}),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [["BlockStored", [1]]]]),
        msgpack.packb([1.0, [["BlockStored", ["x"], None, [1], 1, None]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [-1], 1, None]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0, None]]]),
        msgpack.packb([1.0, [{"block_hashes": [1]}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),
        msgpack.packb([1.0, [7]]),
        msgpack.packb([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_typed_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)
