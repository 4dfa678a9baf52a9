"""Long prompts: RedisIndex's match walk (read chunks, runs of equal values skipped, the walk
limited to candidates, expired prediction entries met on the way) answers exactly as
MemoryIndex does, with and without candidates; predictions of retired slots are swept."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.redis_layout import block_id
from kvtier.residency.types import Match, NodeId

from .conftest import BLOCK, MODEL, FakeEngine, batch, redis_index

pytestmark = pytest.mark.redis

BLOCKS = 150  # crosses 32-block read chunks
SHARED = 70
PROMPTS = [
    list(range(1, 1 + BLOCKS * BLOCK)),
    list(range(1, 1 + SHARED * BLOCK)) + list(range(9000, 9000 + (BLOCKS - SHARED) * BLOCK)),
]
NODES = [NodeId(f"n{i}") for i in range(4)]
SHORT_TTL_S = 0.001
"""Predictions made with this TTL have expired by the time the test matches."""


@dataclass(frozen=True)
class Store:
    node: NodeId
    prompt: int
    end: int
    medium: str


@dataclass(frozen=True)
class Remove:
    node: NodeId
    prompt: int
    blocks: tuple[int, ...]
    medium: str


@dataclass(frozen=True)
class Predict:
    node: NodeId
    prompt: int
    start: int
    end: int
    short: bool


blocks = st.integers(0, BLOCKS - 1)
ops = st.one_of(
    st.builds(
        Store,
        st.sampled_from(NODES),
        st.integers(0, 1),
        st.integers(1, BLOCKS),
        st.sampled_from(["GPU", "CPU"]),
    ),
    st.builds(
        Remove,
        st.sampled_from(NODES),
        st.integers(0, 1),
        st.lists(blocks, min_size=1, max_size=4).map(tuple),
        st.sampled_from(["GPU", "CPU"]),
    ),
    st.builds(
        lambda n, p, a, b, s: Predict(n, p, min(a, b), max(a, b) + 1, s),
        st.sampled_from(NODES),
        st.integers(0, 1),
        blocks,
        blocks,
        st.booleans(),
    ),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(stream=st.lists(ops, min_size=1, max_size=12))
async def test_long_prompts_match_alike(redis_url: str, stream: list[object]) -> None:
    hasher = BlockHasher(MODEL, BLOCK)
    now = [1000.0]
    memory = MemoryIndex(hasher, clock=lambda: now[0])
    redis = redis_index(redis_url, hasher, max_blocks_per_read=32)  # chunks of 32 blocks
    eng = FakeEngine()
    hashes = [hasher.hash_tokens(p) for p in PROMPTS]
    try:
        for op in stream:
            for idx in (memory, redis):
                if isinstance(op, Store):
                    await idx.apply(
                        op.node, batch(eng.stored(PROMPTS[op.prompt], 0, op.end, op.medium))
                    )
                elif isinstance(op, Remove):
                    ev = eng.removed(PROMPTS[op.prompt], op.blocks, op.medium)
                    await idx.apply(op.node, batch(ev))
                elif isinstance(op, Predict):
                    ttl = SHORT_TTL_S if op.short else 60.0
                    await idx.predict(op.node, hashes[op.prompt][op.start : op.end], ttl_s=ttl)
        await asyncio.sleep(0.01)  # the short predictions expire on the Redis clock...
        now[0] += 1.0  # ...and on the memory index's
        for _ in range(2):  # the first walk deletes expired predictions: the second agrees
            for h in hashes:
                for cut in (len(h), 129, 97, 96, 33, 32, 17, 16, 1):
                    for among in (None, NODES[:2], NODES[1::2]):
                        got = await redis.match(h[:cut], among)
                        assert await memory.match(h[:cut], among) == got
    finally:
        await memory.close()
        await redis.close()


async def test_expired_predictions_inside_a_run_end_it(redis_url: str) -> None:
    hasher = BlockHasher(MODEL, BLOCK)
    idx = redis_index(redis_url, hasher)
    eng = FakeEngine()
    a, b = NODES[0], NODES[1]
    hashes = hasher.hash_tokens(PROMPTS[0])
    try:
        await idx.apply(a, batch(eng.stored(PROMPTS[0], 0, 100)))
        await idx.predict(b, hashes, ttl_s=60)
        await idx.predict(b, hashes[90:95], ttl_s=SHORT_TTL_S)  # a newer, shorter prediction
        await asyncio.sleep(0.01)
        want = {a: Match(gpu=100, cpu=0, total=100, predicted=100), b: Match(predicted=90)}
        assert await idx.match(hashes) == want
        assert await idx.match(hashes) == want  # the walk writes nothing: same answer
    finally:
        await idx.close()


async def test_predictions_of_a_retired_slot_are_swept(redis_url: str) -> None:
    hasher = BlockHasher(MODEL, BLOCK)
    idx = redis_index(redis_url, hasher)
    hashes = hasher.hash_tokens(PROMPTS[0])
    a, b, late = NODES[0], NODES[1], NodeId("late")
    client = Redis.from_url(redis_url)
    try:
        await idx.predict(a, hashes[:40], ttl_s=60)
        await idx.predict(b, hashes[:20], ttl_s=60)
        await idx.predict(b, hashes[:20], ttl_s=60)  # replaces b's entries, adds none
        pred, first = idx.keys.pred, block_id(hashes[0])
        assert len(await client.hget(pred, first)) == 2 * 16  # type: ignore[arg-type]
        await idx.forget(a)
        assert await idx.match(hashes) == {b: Match(predicted=20)}
        assert await idx.sweep() == 1
        assert len(await client.hget(pred, first)) == 16  # type: ignore[arg-type]
        assert not await client.hexists(pred, block_id(hashes[30]))
        await idx.predict(late, hashes[:5], ttl_s=60)  # takes the freed slot
        assert await idx.match(hashes) == {b: Match(predicted=20), late: Match(predicted=5)}
    finally:
        await client.aclose()
        await idx.close()
