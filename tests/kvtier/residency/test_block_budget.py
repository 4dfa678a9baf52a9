"""A node's event stream cannot grow the index without bound (issue 30, 5).

Whoever publishes a node's events (a compromised or buggy engine, or anyone who reaches a
subscriber that binds) decides how many blocks the index holds for it: before the fix 54 MiB of
valid events grew a proxy by 339 MiB that stayed. Now each node has a block budget
(``max_blocks_per_node``, router blocks): past it the node's oldest blocks are forgotten (in both
tiers, in the engine-hash map too) and counted in ``translate_stats(node).evicted``; other nodes
keep everything. Forgetting only under-estimates residency (a route a little worse), never
claims a block the node does not hold.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import pytest

from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.translate import TranslateStats
from kvtier.residency.types import Match, NodeId, ResidencyIndex

from .conftest import BLOCK, FakeEngine, batch, redis_index

BUDGET = 24
PROMPT_BLOCKS = 4
PROMPTS = 20  # 80 blocks stored, budget 24
A, B = NodeId("flooder"), NodeId("bystander")


class BudgetedIndex(ResidencyIndex, Protocol):
    def translate_stats(self, node: NodeId) -> TranslateStats: ...


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
async def index(
    request: pytest.FixtureRequest, hasher: BlockHasher
) -> AsyncIterator[BudgetedIndex]:
    idx: BudgetedIndex
    if request.param == "memory":
        idx = MemoryIndex(hasher, max_blocks_per_node=BUDGET)
    else:
        idx = redis_index(request.getfixturevalue("redis_url"), hasher, max_blocks_per_node=BUDGET)
    try:
        yield idx
    finally:
        await idx.close()


def _prompt(n: int) -> list[int]:
    return list(range(1000 * n, 1000 * n + PROMPT_BLOCKS * BLOCK))


def full(n: int, medium: str = "GPU") -> Match:
    if medium == "CPU":
        return Match(gpu=0, cpu=n, total=n, predicted=n)
    return Match(gpu=n, cpu=0, total=n, predicted=n)


async def test_a_flooding_node_keeps_only_its_newest_blocks(
    index: BudgetedIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    bystander = list(range(99_000, 99_000 + 8 * BLOCK))
    await index.apply(B, batch(eng.stored(bystander, 0, 8)))
    for n in range(PROMPTS):
        await index.apply(A, batch(eng.stored(_prompt(n), 0, PROMPT_BLOCKS)))
    kept = BUDGET // PROMPT_BLOCKS
    for n in range(PROMPTS):
        got = await index.match(hasher.hash_tokens(_prompt(n)), among=[A])
        expected = {A: full(PROMPT_BLOCKS)} if n >= PROMPTS - kept else {}
        assert got == expected, (n, got)
    stats = index.translate_stats(A)
    assert stats.evicted == PROMPTS * PROMPT_BLOCKS - BUDGET, stats
    # Another node's budget is its own: nothing of the bystander went.
    assert await index.match(hasher.hash_tokens(bystander)) == {B: full(8)}
    assert index.translate_stats(B).evicted == 0


async def test_eviction_forgets_both_tiers_and_the_engine_hash(
    index: BudgetedIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    first = _prompt(0)
    await index.apply(A, batch(eng.stored(first, 0, 4), eng.stored(first, 0, 4, medium="CPU")))
    for n in range(1, 7):  # 24 more blocks: the first prompt is the oldest and goes
        await index.apply(A, batch(eng.stored(_prompt(n), 0, PROMPT_BLOCKS)))
    assert await index.match(hasher.hash_tokens(first)) == {}
    # Its engine hashes are gone too: a later removal of them resolves to nothing.
    await index.apply(A, batch(eng.removed(first, [0, 1])))
    assert index.translate_stats(A).unresolved == 2
    # Storing it again is a fresh, newest entry (and evicts the now-oldest prompt 1).
    await index.apply(A, batch(eng.stored(first, 0, 4, medium="CPU")))
    assert await index.match(hasher.hash_tokens(first)) == {A: full(4, "CPU")}
    assert await index.match(hasher.hash_tokens(_prompt(1))) == {}
    assert await index.match(hasher.hash_tokens(_prompt(6))) == {A: full(4)}


async def test_one_batch_over_the_budget_keeps_its_newest_blocks(
    index: BudgetedIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    tokens = list(range(40 * BLOCK))
    await index.apply(A, batch(eng.stored(tokens, 0, 40)))
    hashes = hasher.hash_tokens(tokens)
    # The chain's first 16 blocks went, so its prefix is not matched; its tail still is.
    assert await index.match(hashes) == {}
    assert await index.match(hashes[16:]) == {A: full(BUDGET)}
    assert index.translate_stats(A).evicted == 40 - BUDGET


async def test_forget_and_clear_reset_the_budget(index: BudgetedIndex, hasher: BlockHasher) -> None:
    eng = FakeEngine()
    for n in range(6):
        await index.apply(A, batch(eng.stored(_prompt(n), 0, PROMPT_BLOCKS)))
    await index.forget(A)
    for n in range(6, 12):  # exactly the budget again: nothing evicted after the forget
        await index.apply(A, batch(eng.stored(_prompt(n), 0, PROMPT_BLOCKS)))
    assert index.translate_stats(A).evicted == 0
    for n in range(6, 12):
        assert await index.match(hasher.hash_tokens(_prompt(n))) == {A: full(PROMPT_BLOCKS)}


def test_the_budget_is_positive(hasher: BlockHasher) -> None:
    with pytest.raises(ValueError, match="max_blocks_per_node"):
        MemoryIndex(hasher, max_blocks_per_node=0)
