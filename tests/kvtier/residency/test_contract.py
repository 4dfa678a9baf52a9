"""The ResidencyIndex contract, run against MemoryIndex and RedisIndex alike."""

from __future__ import annotations

import asyncio

from kvtier.events import AllBlocksCleared, BlockStored, EventBatch
from kvtier.keys import BlockHasher
from kvtier.residency.types import Match, NodeId, ResidencyIndex

from .conftest import BLOCK, FakeEngine, batch

A, B = NodeId("node-a"), NodeId("node-b")
TOKENS = list(range(100, 100 + 8 * BLOCK))  # 8 full blocks
OTHER = list(range(500, 500 + 8 * BLOCK))


def full(n: int) -> Match:
    return Match(gpu=n, cpu=0, total=n, predicted=n)


async def test_stored_chain_matches_router_hashes(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 5)))
    hashes = hasher.hash_tokens(TOKENS)
    assert await index.match(hashes) == {A: full(5)}
    assert await index.match(hashes[:3]) == {A: full(3)}
    assert await index.match(hasher.hash_tokens(OTHER)) == {}
    assert await index.match([]) == {}
    assert await index.nodes() == [A]


async def test_parent_links_continue_the_chain(index: ResidencyIndex, hasher: BlockHasher) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 2)))
    await index.apply(A, batch(eng.stored(TOKENS, 2, 6), eng.stored(TOKENS, 6, 7)))
    assert await index.match(hasher.hash_tokens(TOKENS)) == {A: full(7)}


async def test_unknown_parent_is_not_indexed(index: ResidencyIndex, hasher: BlockHasher) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 3, 6)))
    assert await index.match(hasher.hash_tokens(TOKENS)) == {}


async def test_removed_blocks_resolve_through_the_map(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 6)))
    await index.apply(A, batch(eng.removed(TOKENS, [4])))
    hashes = hasher.hash_tokens(TOKENS)
    assert await index.match(hashes) == {A: full(4)}
    await index.apply(A, batch(eng.removed(TOKENS, [1])))
    assert await index.match(hashes) == {A: full(1)}
    await index.apply(A, batch(eng.removed(TOKENS, [0, 99])))  # 99: never stored
    assert await index.match(hashes) == {}


async def test_tiers_are_measured_separately(index: ResidencyIndex, hasher: BlockHasher) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 3), eng.stored(TOKENS, 0, 6, "CPU")))
    hashes = hasher.hash_tokens(TOKENS)
    assert await index.match(hashes) == {A: Match(gpu=3, cpu=6, total=6, predicted=6)}
    await index.apply(A, batch(eng.removed(TOKENS, [0, 1, 2], "CPU")))
    # GPU 0-2 and CPU 3-5 still make six leading blocks in some tier.
    assert await index.match(hashes) == {A: Match(gpu=3, cpu=0, total=6, predicted=6)}
    await index.apply(A, batch(eng.removed(TOKENS, [3], "CPU")))
    assert await index.match(hashes) == {A: Match(gpu=3, cpu=0, total=3, predicted=3)}


async def test_total_spans_tiers(index: ResidencyIndex, hasher: BlockHasher) -> None:
    """GPU holds blocks 0-1, CPU holds 2-4: the node holds 5 leading blocks in some tier."""
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 2), eng.stored(TOKENS, 2, 5, "CPU")))
    assert await index.match(hasher.hash_tokens(TOKENS)) == {
        A: Match(gpu=2, cpu=0, total=5, predicted=5)
    }


async def test_medium_none_means_gpu_and_unknown_media_are_skipped(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine(medium=None)
    await index.apply(A, batch(eng.stored(TOKENS, 0, 2)))
    await index.apply(B, batch(eng.stored(TOKENS, 0, 2, "DISK")))
    assert await index.match(hasher.hash_tokens(TOKENS)) == {A: full(2)}


async def test_engine_blocks_larger_than_router_blocks(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine(block_size=2 * BLOCK)
    await index.apply(A, batch(eng.stored(TOKENS, 0, 2), eng.stored(TOKENS, 2, 3)))
    hashes = hasher.hash_tokens(TOKENS)
    assert await index.match(hashes) == {A: full(6)}
    await index.apply(A, batch(eng.removed(TOKENS, [1])))
    assert await index.match(hashes) == {A: full(2)}


async def test_unrepresentable_events_are_skipped(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    lora = eng.stored(TOKENS, 0, 3, lora_name="adapter")
    salted = eng.stored(TOKENS, 0, 3, extra_keys=(("salt",), None, None))
    other_group = eng.stored(TOKENS, 0, 3, group_idx=1)
    odd = BlockStored((1,), None, tuple(TOKENS[: BLOCK + 1]), BLOCK + 1, None, "GPU")
    await index.apply(A, batch(lora, salted, other_group, odd))
    assert await index.match(hasher.hash_tokens(TOKENS)) == {}


async def test_a_salted_chain_matches_only_the_same_salt(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    """Block 0's only extra key a string (vLLM's form for ``cache_salt``): indexed under that
    salt, so a request of the same tenant matches it and no other request does."""
    eng = FakeEngine()
    salted = eng.stored(TOKENS, 0, 3, extra_keys=(("tenant-a",), None, None))
    await index.apply(A, batch(salted, eng.stored(TOKENS, 3, 5)))
    assert await index.match(hasher.hash_tokens(TOKENS, cache_salt="tenant-a")) == {A: full(5)}
    assert await index.match(hasher.hash_tokens(TOKENS, cache_salt="tenant-b")) == {}
    assert await index.match(hasher.hash_tokens(TOKENS)) == {}
    # Other extra keys (multimodal hashes, a salt past block 0) stay unrepresentable.
    for extra in ((("x", 3),), (None, ("late",)), ((7,),)):
        await index.apply(B, batch(eng.stored(OTHER, 0, len(extra), extra_keys=extra)))
    for salt in (None, "x", "late"):
        assert await index.match(hasher.hash_tokens(OTHER, cache_salt=salt)) == {}


async def test_nodes_are_independent(index: ResidencyIndex, hasher: BlockHasher) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 6)))
    await index.apply(B, batch(eng.stored(TOKENS, 0, 2), eng.stored(OTHER, 0, 8)))
    assert await index.match(hasher.hash_tokens(TOKENS)) == {A: full(6), B: full(2)}
    assert await index.match(hasher.hash_tokens(OTHER)) == {B: full(8)}
    assert sorted(await index.nodes()) == [A, B]


async def test_all_blocks_cleared_empties_the_node(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 6)))
    await index.apply(B, batch(eng.stored(TOKENS, 0, 3)))
    await index.apply(A, EventBatch(1.0, (AllBlocksCleared(),)))
    hashes = hasher.hash_tokens(TOKENS)
    assert await index.match(hashes) == {B: full(3)}
    assert sorted(await index.nodes()) == [A, B]  # A still reports, it just holds nothing
    await index.apply(A, batch(eng.stored(TOKENS, 0, 2)))
    assert await index.match(hashes) == {A: full(2), B: full(3)}
    # The map was cleared too: a child of a pre-clear block does not resolve.
    await index.apply(A, batch(eng.stored(TOKENS, 3, 5)))
    assert (await index.match(hashes))[A] == full(2)


async def test_forget_drops_the_node_then_it_can_return(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    await index.apply(A, batch(eng.stored(TOKENS, 0, 6)))
    await index.apply(B, batch(eng.stored(TOKENS, 0, 3)))
    await index.predict(A, hasher.hash_tokens(OTHER), ttl_s=30)
    await index.forget(A)
    hashes = hasher.hash_tokens(TOKENS)
    assert await index.match(hashes) == {B: full(3)}
    assert await index.match(hasher.hash_tokens(OTHER)) == {}
    assert await index.nodes() == [B]
    await index.apply(A, batch(eng.stored(TOKENS, 0, 1)))
    assert await index.match(hashes) == {A: full(1), B: full(3)}
    await index.forget(NodeId("never-seen"))


async def test_predictions_extend_the_match_and_expire(
    index: ResidencyIndex, hasher: BlockHasher
) -> None:
    eng = FakeEngine()
    hashes = hasher.hash_tokens(TOKENS)
    await index.apply(A, batch(eng.stored(TOKENS, 0, 3)))
    await index.predict(A, hashes, ttl_s=30)
    await index.predict(B, hashes[:5], ttl_s=0.4)
    assert await index.match(hashes) == {
        A: Match(gpu=3, cpu=0, total=3, predicted=8),
        B: Match(gpu=0, cpu=0, total=0, predicted=5),
    }
    assert sorted(await index.nodes()) == [A, B]
    await asyncio.sleep(0.6)
    assert await index.match(hashes) == {A: Match(gpu=3, cpu=0, total=3, predicted=8)}
    # A prediction confirmed by events and then evicted is gone once it expires.
    await index.predict(B, hashes[:2], ttl_s=0.4)
    await index.apply(B, batch(eng.stored(TOKENS, 0, 2)))
    await index.apply(B, batch(eng.removed(TOKENS, [1])))
    assert (await index.match(hashes))[B] == Match(gpu=1, cpu=0, total=1, predicted=2)
    await asyncio.sleep(0.6)
    assert (await index.match(hashes))[B] == full(1)


async def test_prediction_gaps_break_contiguity(index: ResidencyIndex, hasher: BlockHasher) -> None:
    hashes = hasher.hash_tokens(TOKENS)
    await index.predict(A, [hashes[0], hashes[2]], ttl_s=30)
    assert await index.match(hashes) == {A: Match(predicted=1)}


async def test_match_among_candidates(index: ResidencyIndex, hasher: BlockHasher) -> None:
    """A match among candidates answers exactly the full match restricted to them; nodes the
    index does not know and candidates holding nothing are simply absent."""
    eng = FakeEngine()
    c, ghost = NodeId("node-c"), NodeId("never-seen")
    hashes = hasher.hash_tokens(TOKENS)
    await index.apply(A, batch(eng.stored(TOKENS, 0, 6)))
    await index.apply(B, batch(eng.stored(TOKENS, 0, 3, medium="CPU")))
    await index.predict(c, hashes[:2], ttl_s=60)
    everything = await index.match(hashes)
    assert set(everything) == {A, B, c}
    for among in ([A], [B, c], [A, B, c, ghost], [ghost], []):
        want = {n: m for n, m in everything.items() if n in among}
        assert await index.match(hashes, among) == want, among
    await index.apply(NodeId("idle"), batch(eng.stored(OTHER, 0, 8)))
    assert await index.match(hashes, [NodeId("idle")]) == {}
