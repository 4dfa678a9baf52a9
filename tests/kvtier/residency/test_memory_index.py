"""MemoryIndex beyond the shared contract: node capacity, translation counters, clock."""

from __future__ import annotations

import pytest

from kvtier.errors import ResidencyError
from kvtier.events import BlockStored
from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import Match, NodeId

from .conftest import BLOCK, FakeEngine, batch

TOKENS = list(range(3, 3 + 6 * BLOCK))


async def test_node_capacity_is_enforced_and_freed(hasher: BlockHasher) -> None:
    idx = MemoryIndex(hasher, max_nodes=2)
    eng = FakeEngine()
    await idx.apply(NodeId("a"), batch(eng.stored(TOKENS, 0, 1)))
    await idx.apply(NodeId("b"), batch(eng.stored(TOKENS, 0, 2)))
    with pytest.raises(ResidencyError):
        await idx.apply(NodeId("c"), batch(eng.stored(TOKENS, 0, 3)))
    await idx.forget(NodeId("a"))
    await idx.apply(NodeId("c"), batch(eng.stored(TOKENS, 0, 3)))
    hashes = hasher.hash_tokens(TOKENS)
    assert await idx.match(hashes) == {
        NodeId("b"): Match(2, 0, 2, 2),
        NodeId("c"): Match(3, 0, 3, 3),
    }


async def test_translation_counters(hasher: BlockHasher) -> None:
    idx = MemoryIndex(hasher)
    eng = FakeEngine()
    node = NodeId("a")
    await idx.apply(
        node,
        batch(
            eng.stored(TOKENS, 0, 2),
            eng.stored(TOKENS, 4, 6),  # parent never stored
            eng.stored(TOKENS, 2, 3, lora_name="x"),
            eng.removed(TOKENS, [1, 5]),
            BlockStored((9,), None, tuple(TOKENS[:BLOCK]), BLOCK, None, "NVME"),
        ),
    )
    stats = idx.translate_stats(node)
    assert (stats.stored, stats.removed, stats.unresolved, stats.skipped) == (2, 1, 3, 2)
    assert idx.translate_stats(NodeId("unknown")).stored == 0


async def test_predictions_follow_the_injected_clock(hasher: BlockHasher) -> None:
    now = [100.0]
    idx = MemoryIndex(hasher, clock=lambda: now[0])
    hashes = hasher.hash_tokens(TOKENS)
    await idx.predict(NodeId("a"), hashes[:4], ttl_s=5)
    await idx.predict(NodeId("a"), hashes[:2], ttl_s=1)  # a newer, shorter prediction wins
    assert await idx.match(hashes) == {NodeId("a"): Match(predicted=4)}
    now[0] = 101.0
    assert await idx.match(hashes) == {}
    with pytest.raises(ValueError):
        await idx.predict(NodeId("a"), hashes, ttl_s=0)
