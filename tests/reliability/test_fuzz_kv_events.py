"""Hostile KV event payloads: skipped and counted, never trusted, never fatal.

Two layers: hypothesis drives structured-but-hostile msgpack batches through the decoder and the
residency index (decode either refuses with ``EventDecodeError`` or yields a batch the index
applies without raising), and a live ZMQ publisher sends garbage frames to a real
:class:`EventSubscriber` feeding a :class:`MemoryIndex`: every bad message is counted as
malformed, the good batches around them still land, and the subscriber keeps running.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.errors import EventDecodeError
from kvtier.events.codec import decode_batch, encode_batch
from kvtier.events.publisher import seq_frame
from kvtier.events.subscriber import EventSubscriber
from kvtier.events.types import BlockStored, EventBatch
from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import NodeId
from tests.conftest import free_port

from .record import Tally, long_mode

_BLOCK = 4
_HUGE = st.sampled_from([2**64, 2**64 - 1, -(2**63), -1, 2**63, 0])
_INT = st.one_of(st.integers(-(2**63), 2**64 - 1), _HUGE)
_ANY = st.recursive(
    st.one_of(
        st.none(), st.booleans(), _INT, st.floats(), st.text(max_size=8), st.binary(max_size=8)
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_HASHES = st.one_of(st.lists(st.one_of(_INT, st.binary(max_size=40)), max_size=6), _ANY)
_TOKENS = st.one_of(
    st.lists(st.integers(0, 300), max_size=3 * _BLOCK),
    st.lists(_INT, max_size=12),
    st.lists(st.integers(0, 2**64 - 1), min_size=_BLOCK, max_size=_BLOCK),
    _ANY,
)
_MEDIUM = st.one_of(st.sampled_from(["GPU", "CPU", "cpu", "", "DISK"]), st.none(), _ANY)
_STORED_ARRAY = st.tuples(
    st.just("BlockStored"),
    _HASHES,
    st.one_of(st.none(), _INT, st.binary(max_size=8), _ANY),
    _TOKENS,
    st.one_of(st.just(_BLOCK), _INT, _ANY),
    st.one_of(st.none(), _INT),
    _MEDIUM,
).map(list)
_STORED_MAP = st.fixed_dictionaries(
    {"type": st.just("BlockStored")},
    optional={
        "block_hashes": _HASHES,
        "parent_block_hash": st.one_of(st.none(), _INT),
        "token_ids": _TOKENS,
        "block_size": st.one_of(st.just(_BLOCK), _INT),
        "medium": _MEDIUM,
        "group_idx": st.one_of(st.none(), _INT, _ANY),
        "extra_keys": _ANY,
        "lora_id": st.one_of(st.none(), _INT),
    },
)
_REMOVED = st.one_of(
    st.tuples(st.just("BlockRemoved"), _HASHES, _MEDIUM).map(list),
    st.fixed_dictionaries({"type": st.just("BlockRemoved"), "block_hashes": _HASHES}),
)
_EVENT = st.one_of(
    _STORED_ARRAY,
    _STORED_MAP,
    _REMOVED,
    st.just(["AllBlocksCleared"]),
    st.lists(_ANY, max_size=4),
    _ANY,
)
_BATCH = st.one_of(
    st.tuples(
        st.one_of(st.floats(), _INT, _ANY), st.lists(_EVENT, max_size=5), st.one_of(st.none(), _INT)
    ).map(list),
    _ANY,
)


def _pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, use_bin_type=True)
    return data


def _packable(value: Any) -> bool:
    try:
        msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


@settings(
    max_examples=3000 if long_mode() else 300,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
@given(st.one_of(_BATCH.filter(_packable).map(_pack), st.binary(max_size=64)))
def test_fuzz_kv_event_payload_decode_and_apply(tally: Tally, payload: bytes) -> None:
    """Decoding refuses what is malformed; what decodes, the index applies without raising."""
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        tally.ok()  # skipped (the subscriber counts it as malformed)
        return
    index = MemoryIndex(BlockHasher("fuzz", _BLOCK))
    try:
        asyncio.run(index.apply(NodeId("node"), batch))
    except Exception as exc:
        tally.fail(f"{type(exc).__name__}: {str(exc)[:160]}")
        raise
    tally.ok()


def _good_batch(i: int) -> bytes:
    tokens = tuple(range(i * _BLOCK, (i + 1) * _BLOCK))
    stored = BlockStored(
        block_hashes=(1000 + i,),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=_BLOCK,
        lora_id=None,
        medium="GPU",
    )
    return encode_batch(EventBatch(ts=float(i), events=(stored,)))


_HOSTILE_MESSAGES: list[list[bytes]] = [
    [b"kv", b"\x00" * 8],  # two frames
    [b"kv", b"\x00" * 7, b"x"],  # short sequence frame
    [b"kv", b"\x00" * 9, b"x"],  # long sequence frame
    [b"kv", b"", _pack([0.0, []])],
    [b"kv", b"\x00" * 8, b"x", b"y"],  # four frames
]
# Messages with a good frame layout but a payload that cannot be decoded (seq numbers follow).
_HOSTILE_PAYLOADS: list[bytes] = [
    b"\xc1",  # msgpack's never-used byte
    b"not msgpack at all",
    _pack({"ts": "yesterday", "events": []}),
    _pack([0.0, [["BlockStored", "not a list"]]]),
    _pack([0.0, [["BlockStored", [1], None, [1, 2], -4, None, "GPU"]]]),
    _pack([0.0, [{"type": "BlockStored", "token_ids": [-1]}]]),
    _pack([0.0, "events"]),
    b"\x91" * 10_000,  # deep nesting
]


async def test_fuzz_kv_event_stream_hostile_publisher(tally: Tally) -> None:
    """A publisher that interleaves garbage with good batches: garbage counted, good applied."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    index = MemoryIndex(BlockHasher("fuzz", _BLOCK))
    node = NodeId("hostile")
    applied: list[EventBatch] = []

    async def on_batch(batch: EventBatch) -> None:
        applied.append(batch)
        await index.apply(node, batch)

    sub = EventSubscriber(endpoint, None, on_batch=on_batch, topic="kv", name="hostile")
    try:
        await sub.start()
        # Slow joiner: publish good batch 0 until the subscriber sees it.
        for _ in range(200):
            await pub.send_multipart([b"kv", seq_frame(0), _good_batch(0)])
            await asyncio.sleep(0.02)
            if sub.stats.delivered:
                break
        assert sub.stats.delivered == 1, "the subscriber never connected"
        seq = 1
        for frames in _HOSTILE_MESSAGES:
            await pub.send_multipart(frames)
            tally.ok()
        for payload in _HOSTILE_PAYLOADS:
            await pub.send_multipart([b"kv", seq_frame(seq), payload])
            seq += 1
            tally.ok()
        await pub.send_multipart([b"kv", seq_frame(seq), _good_batch(1)])
        for _ in range(200):
            if sub.stats.delivered >= 2:
                break
            await asyncio.sleep(0.01)
        expected_bad = len(_HOSTILE_MESSAGES) + len(_HOSTILE_PAYLOADS)
        assert sub.running, "a hostile message stopped the subscriber"
        assert sub.stats.malformed == expected_bad, sub.stats
        assert sub.stats.delivered == 2 and len(applied) == 2, sub.stats
        assert sub.stats.handler_errors == 0, sub.stats
        tally.notes.append(f"malformed counted: {sub.stats.malformed}/{expected_bad}")
    finally:
        await sub.close()
        pub.close(linger=0)
        ctx.term()
