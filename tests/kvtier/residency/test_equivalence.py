"""Property: any event stream gives the same match answers in MemoryIndex and RedisIndex."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.events import AllBlocksCleared, EventBatch
from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import NodeId

from .conftest import BLOCK, MODEL, FakeEngine, batch, redis_index

pytestmark = pytest.mark.redis

BLOCKS = 6
_BASE = list(range(1, 1 + BLOCKS * BLOCK))
PROMPTS = [
    _BASE,
    _BASE[: 2 * BLOCK] + list(range(900, 900 + (BLOCKS - 2) * BLOCK)),  # shares 2 blocks
    list(range(2000, 2000 + BLOCKS * BLOCK)),
]
NODES = [NodeId(f"n{i}") for i in range(3)]
MEDIA = ["GPU", "CPU", None]


@dataclass(frozen=True)
class Store:
    node: NodeId
    prompt: int
    start: int
    end: int
    medium: str | None


@dataclass(frozen=True)
class Remove:
    node: NodeId
    prompt: int
    blocks: tuple[int, ...]
    medium: str | None


@dataclass(frozen=True)
class Clear:
    node: NodeId


@dataclass(frozen=True)
class Forget:
    node: NodeId


@dataclass(frozen=True)
class Predict:
    node: NodeId
    prompt: int
    start: int
    end: int


nodes = st.sampled_from(NODES)
prompts = st.integers(0, len(PROMPTS) - 1)
spans = st.tuples(st.integers(0, BLOCKS - 1), st.integers(1, BLOCKS)).filter(lambda s: s[0] < s[1])
ops = st.one_of(
    st.builds(
        lambda n, p, s, m: Store(n, p, s[0], s[1], m), nodes, prompts, spans, st.sampled_from(MEDIA)
    ),
    st.builds(
        Remove,
        nodes,
        prompts,
        st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=3).map(tuple),
        st.sampled_from(MEDIA),
    ),
    st.builds(Clear, nodes),
    st.builds(Forget, nodes),
    st.builds(lambda n, p, s: Predict(n, p, s[0], s[1]), nodes, prompts, spans),
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(stream=st.lists(ops, min_size=1, max_size=25))
async def test_same_answers(redis_url: str, stream: list[object]) -> None:
    hasher = BlockHasher(MODEL, BLOCK)
    memory = MemoryIndex(hasher)
    redis = redis_index(redis_url, hasher)  # a fresh namespace per example
    eng = FakeEngine()
    hashes = [hasher.hash_tokens(p) for p in PROMPTS]
    try:
        for op in stream:
            for idx in (memory, redis):
                if isinstance(op, Store):
                    ev = eng.stored(PROMPTS[op.prompt], op.start, op.end, op.medium)
                    await idx.apply(op.node, batch(ev))
                elif isinstance(op, Remove):
                    ev2 = eng.removed(PROMPTS[op.prompt], op.blocks, op.medium)
                    await idx.apply(op.node, batch(ev2))
                elif isinstance(op, Clear):
                    await idx.apply(op.node, EventBatch(0.0, (AllBlocksCleared(),)))
                elif isinstance(op, Forget):
                    await idx.forget(op.node)
                elif isinstance(op, Predict):
                    await idx.predict(op.node, hashes[op.prompt][op.start : op.end], ttl_s=60)
        for h in hashes:
            for cut in (len(h), 3, 1):
                assert await memory.match(h[:cut]) == await redis.match(h[:cut])
        assert sorted(await memory.nodes()) == sorted(await redis.nodes())
    finally:
        await memory.close()
        await redis.close()
