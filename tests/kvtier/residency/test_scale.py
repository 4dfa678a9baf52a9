"""The index at deployment scale: 1,024 nodes per model over every implementation (memory,
Redis, Redis Cluster), idle nodes that cost a match nothing, and bounded Redis calls for
prompts of any size."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from redis import Redis as SyncRedis

from kvtier.events import BlockStored, EventBatch
from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.redis_client import connect
from kvtier.residency.redis_index import RedisIndex
from kvtier.residency.types import Match, NodeId, ResidencyIndex

from .conftest import BLOCK, FakeEngine, batch, redis_index

NODES = 1024
PROMPT = list(range(7, 7 + 40 * BLOCK))  # 40 blocks


def _stored_by_router_hash(hasher: BlockHasher, tokens: list[int], n: int) -> EventBatch:
    """Blocks 0..n-1 stored, engine hashes equal to the router's (as kvtier workers send)."""
    hashes = hasher.hash_tokens(tokens[: n * BLOCK])
    return batch(BlockStored(tuple(hashes), None, tuple(tokens[: n * BLOCK]), BLOCK))


async def _apply_all(index: ResidencyIndex, items: list[tuple[NodeId, EventBatch]]) -> None:
    many = getattr(index, "apply_many", None)
    if many is None:
        for node, b in items:
            await index.apply(node, b)
        return
    for i in range(0, len(items), 64):
        await many(items[i : i + 64])


async def test_a_thousand_nodes_per_model(index: ResidencyIndex, hasher: BlockHasher) -> None:
    """1,024 nodes each hold a different prefix length of one prompt (1..40 blocks, tiers
    alternating); every node's match is exact, forgetting half leaves the other half exact,
    and the forgotten ones come back."""
    nodes = [NodeId(f"w{i:04d}") for i in range(NODES)]
    eng_gpu, eng_cpu = FakeEngine(medium="GPU"), FakeEngine(medium="CPU")

    def held(i: int) -> int:
        return 1 + i % 40

    def expected(i: int) -> Match:
        n = held(i)
        return Match(gpu=n, cpu=0, total=n, predicted=n) if i % 2 == 0 else Match(0, n, n, n)

    items = [
        (node, batch((eng_gpu if i % 2 == 0 else eng_cpu).stored(PROMPT, 0, held(i))))
        for i, node in enumerate(nodes)
    ]
    await _apply_all(index, items)
    hashes = hasher.hash_tokens(PROMPT)
    assert await index.match(hashes) == {node: expected(i) for i, node in enumerate(nodes)}
    assert len(await index.nodes()) == NODES
    for node in nodes[::2]:
        await index.forget(node)
    assert await index.match(hashes) == {
        node: expected(i) for i, node in enumerate(nodes) if i % 2 == 1
    }
    await _apply_all(index, [(n, b) for n, b in items[::2]])
    assert len(await index.match(hashes)) == NODES


async def test_idle_nodes_cost_a_match_nothing(index: ResidencyIndex, hasher: BlockHasher) -> None:
    """A prompt two nodes hold matches just those two, whether 0 or 1,022 other nodes hold
    other prompts; with Redis the match sends the same calls either way."""
    eng = FakeEngine()
    a, b = NodeId("holder-a"), NodeId("holder-b")
    await index.apply(a, batch(eng.stored(PROMPT, 0, 40)))
    await index.apply(b, batch(eng.stored(PROMPT, 0, 10)))
    hashes = hasher.hash_tokens(PROMPT)
    want = {a: Match(40, 0, 40, 40), b: Match(10, 0, 10, 10)}

    async def calls_of_match() -> int:
        before = index.calls if isinstance(index, RedisIndex) else 0
        assert await index.match(hashes) == want
        return (index.calls if isinstance(index, RedisIndex) else 0) - before

    await calls_of_match()  # caches the holders' names
    alone = await calls_of_match()
    others = [
        (NodeId(f"idle{i:04d}"), batch(eng.stored([100_000 + i, *PROMPT[1:]], 0, 40)))
        for i in range(NODES - 2)
    ]
    await _apply_all(index, others)
    assert len(await index.nodes()) == NODES
    assert await calls_of_match() == alone


@pytest.mark.redis
async def test_calls_are_chunked_and_bounded(redis_url: str, hasher: BlockHasher) -> None:
    """Every script call and read names at most ``max_blocks_per_call`` blocks: a 1,000-block
    store, prediction and match are split, and answer as one call would."""
    limit = 64
    idx = redis_index(redis_url, hasher, max_blocks_per_call=limit, max_blocks_per_read=limit)
    tokens = list(range(1000 * BLOCK))
    hashes = hasher.hash_tokens(tokens)
    a, b = NodeId("a"), NodeId("b")
    chunks = -(-1000 // limit)
    try:
        before = idx.calls
        await idx.apply(a, _stored_by_router_hash(hasher, tokens, 1000))
        # 1,000 residency keys and 1,000 engine-hash map entries, 64 per call.
        assert idx.calls - before == -(-2000 // limit)
        before = idx.calls
        await idx.predict(b, hashes, ttl_s=60)
        assert idx.calls - before == chunks
        before = idx.calls
        assert await idx.match(hashes) == {a: Match(1000, 0, 1000, 1000), b: Match(predicted=1000)}
        # Read chunks, then one HMGET of the matched slots' names (cached afterwards).
        assert idx.calls - before == chunks + 1
        with pytest.raises(ValueError, match="16 bytes"):
            await idx.predict(b, [*hashes[:3], b"short"], ttl_s=60)  # type: ignore[list-item]
    finally:
        await idx.close()


@pytest.mark.redis
async def test_huge_prompt_does_not_stall_redis(redis_url: str, hasher: BlockHasher) -> None:
    """A 100,000-block prediction and match run as bounded calls while another client pings
    from a thread: the calls are counted (the bound); the pings' worst wait and the longest
    command Redis ran (its SLOWLOG) are printed (measurements, not asserted)."""
    idx = redis_index(redis_url, hasher, deadline_s=120)  # the whole prompt, not one chunk
    limit, read_limit = idx.max_blocks_per_call, idx.max_blocks_per_read
    n = 100_000
    hashes = [i.to_bytes(16, "big") for i in range(n)]  # any 16-byte keys will do here
    pinger = SyncRedis.from_url(redis_url)
    pinger.config_set("slowlog-log-slower-than", 0)  # this test's own server
    pinger.config_set("slowlog-max-len", 100_000)
    pinger.slowlog_reset()
    waits: list[float] = []
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            pinger.ping()
            waits.append(time.perf_counter() - t0)
            time.sleep(0.001)

    thread = threading.Thread(target=ping)
    thread.start()
    t0 = time.perf_counter()
    try:
        before = idx.calls
        await idx.predict(NodeId("big"), hashes, ttl_s=60)
        assert idx.calls - before == -(-n // limit)
        before = idx.calls
        assert await idx.match(hashes) == {NodeId("big"): Match(predicted=n)}
        assert idx.calls - before == -(-n // read_limit) + 1
    finally:
        stop.set()
        thread.join()
        log = pinger.slowlog_get(100_000)
        durations = sorted(e["duration"] for e in log if e["command"].startswith(b"EVALSHA"))
        pinger.config_set("slowlog-log-slower-than", 10_000)
        pinger.config_set("slowlog-max-len", 128)
        pinger.close()
        await idx.close()
    took = time.perf_counter() - t0
    print(
        f"100k-block predict+match took {took * 1000:.0f} ms; {len(waits)} PINGs from a thread "
        f"meanwhile, worst {max(waits) * 1000:.1f} ms; script calls: "
        f"{len(durations)}, median {durations[len(durations) // 2] / 1000:.2f} ms, "
        f"longest {durations[-1] / 1000:.1f} ms"
    )


@pytest.mark.redis
async def test_every_key_of_a_model_is_in_one_cluster_slot(
    redis_cluster_url: str, hasher: BlockHasher
) -> None:
    """Even with a model seed holding braces, every key the index writes hashes to the slot
    of the model's tag."""
    seed_hasher = BlockHasher("we{ir}d}", BLOCK)
    idx = redis_index(redis_cluster_url, seed_hasher)
    eng = FakeEngine()
    client = connect(redis_cluster_url, socket_timeout_s=2, connect_timeout_s=2)
    try:
        await idx.apply(NodeId("a"), batch(eng.stored(PROMPT, 0, 5)))
        await idx.predict(NodeId("b"), seed_hasher.hash_tokens(PROMPT), ttl_s=60)
        await idx.forget(NodeId("a"))
        assert await idx.sweep() == 1
        tag = idx.keys.tag.encode()
        keys = [k async for k in client.scan_iter(match=tag.replace(b"{", b"\\{") + b"*")]
        assert idx.keys.pred in keys and len(keys) >= 6
        slots = {await client.cluster_keyslot(k) for k in keys}  # type: ignore[arg-type]
        assert slots == {await client.cluster_keyslot(tag)}  # type: ignore[arg-type]
    finally:
        await client.aclose()
        await idx.close()


def test_memory_index_has_no_node_cap(hasher: BlockHasher) -> None:
    idx = MemoryIndex(hasher)
    eng = FakeEngine()

    async def run() -> None:
        for i in range(5000):
            await idx.apply(NodeId(f"n{i}"), batch(eng.stored(PROMPT, 0, 1)))
        assert len(await idx.match(hasher.hash_tokens(PROMPT))) == 5000

    asyncio.run(run())
