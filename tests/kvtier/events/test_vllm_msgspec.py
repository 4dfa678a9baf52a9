"""Cross-check against msgspec structs declared the way vLLM declares its KV events.

vLLM publishes with ``msgspec.msgpack.Encoder``; these structs restate its schema (array
generation with every field up to ``kv_cache_spec_sliding_window``, and the map generation).
"""

from typing import Any

import pytest

from kvtier.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventEncoding,
    decode_batch,
    encode_batch,
)

msgspec = pytest.importorskip("msgspec")


def _schema(array_like: bool) -> tuple[Any, Any]:
    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[misc,call-arg,name-defined]
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):  # type: ignore[misc,call-arg,name-defined]
        pass

    class VStored(Event, tag="BlockStored"):  # type: ignore[call-arg]
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class VRemoved(Event, tag="BlockRemoved"):  # type: ignore[call-arg]
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class VCleared(Event, tag="AllBlocksCleared"):  # type: ignore[call-arg]
        pass

    class KVEventBatch(Batch):
        events: list[VStored | VRemoved | VCleared]

    return KVEventBatch, (VStored, VRemoved, VCleared)


@pytest.mark.parametrize("array_like", [True, False])
def test_we_decode_what_vllm_encodes(array_like: bool) -> None:
    batch_t, (stored_t, removed_t, cleared_t) = _schema(array_like)
    vllm_batch = batch_t(
        ts=12.5,
        events=[
            stored_t([2**64 - 1, 5], None, list(range(32)), 16, None, "GPU", None),
            stored_t([b"\x01" * 32], 5, list(range(16)), 16, 3, "CPU", "lora", [None], 0),
            removed_t([5], "CPU", 1),
            cleared_t(),
        ],
        data_parallel_rank=2,
    )
    ours = decode_batch(msgspec.msgpack.encode(vllm_batch))
    assert ours == EventBatch(
        ts=12.5,
        events=(
            BlockStored((2**64 - 1, 5), None, tuple(range(32)), 16, None, "GPU"),
            BlockStored((b"\x01" * 32,), 5, tuple(range(16)), 16, 3, "CPU", "lora", (None,), 0),
            BlockRemoved((5,), "CPU", 1),
            AllBlocksCleared(),
        ),
        data_parallel_rank=2,
    )


@pytest.mark.parametrize(
    ("array_like", "encoding"), [(True, EventEncoding.ARRAY), (False, EventEncoding.MAP)]
)
def test_vllm_decodes_what_we_encode(array_like: bool, encoding: EventEncoding) -> None:
    batch_t, (stored_t, removed_t, cleared_t) = _schema(array_like)
    ours = EventBatch(
        ts=1.0,
        events=(
            BlockStored((1, 2), None, tuple(range(32)), 16, None, "GPU", group_idx=0),
            BlockRemoved((2,), "CPU"),
            AllBlocksCleared(),
        ),
    )
    payload = encode_batch(ours, encoding)
    decoded = msgspec.msgpack.decode(payload, type=batch_t)
    assert decoded == batch_t(
        ts=1.0,
        events=[
            stored_t([1, 2], None, list(range(32)), 16, None, "GPU", None, None, 0),
            removed_t([2], "CPU"),
            cleared_t(),
        ],
    )
    # Byte for byte what vLLM's encoder writes for the same batch.
    assert payload == msgspec.msgpack.encode(decoded)
