"""Benchmark: residency match and event apply, MemoryIndex vs RedisIndex (prints; asserts nothing).

    python -m loadtest.bench_residency [--nodes 8] [--blocks 512] [--repeat 2000]
                                       [--apply-blocks 200000] [--redis-url URL]

Match: one 512-block prompt (8,192 tokens), ``--nodes`` nodes each holding a random prefix of it
(GPU, some also CPU, one with predictions). Apply: the events are spread over ``--nodes``
simulated workers and applied by one writer (``--nodes 1024 --apply-blocks 524288``: the
1,024-worker ingest), BlockStored events of ``--event-blocks`` blocks
with token ids (the index rehashes them), ``--pipeline`` batches per Redis round trip.
Baselines measured in the same run: a Redis PING round trip, and the same number of plain
HSETs pipelined. Starts its own redis-server on a free port unless ``--redis-url`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis

from kvtier.events import BlockStored, EventBatch
from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.redis_index import RedisIndex, RedisIndexSettings
from kvtier.residency.types import NodeId, ResidencyIndex
from loadtest.redis_server import own_redis_server


def stored(tokens: list[int], start: int, end: int, bs: int, medium: str) -> BlockStored:
    """An engine event whose engine hashes are simply the block positions' token prefix ids."""
    return BlockStored(
        block_hashes=tuple(hash_id(tokens, b) for b in range(start, end)),
        parent_block_hash=hash_id(tokens, start - 1) if start else None,
        token_ids=tuple(tokens[start * bs : end * bs]),
        block_size=bs,
        medium=medium,
    )


def _blocks(batch: EventBatch) -> int:
    return sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))


async def _evalsha_stats(client: Redis) -> tuple[int, int]:
    """(calls, µs) of EVALSHA so far, from INFO commandstats (read-only)."""
    stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def hash_id(tokens: list[int], block: int) -> int:
    return (id(tokens) << 20) | block


async def timed(fn: Callable[[], Awaitable[object]], repeat: int, budget_s: float) -> list[float]:
    samples: list[float] = []
    stop = time.monotonic() + budget_s
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        await fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
        if time.monotonic() > stop:
            break
    return samples


def row(name: str, samples: list[float], base: float) -> str:
    samples = sorted(samples)
    p50 = statistics.median(samples)
    p99 = samples[max(0, int(len(samples) * 0.99) - 1)]
    return f"{name:42} {p50:10.1f} {p99:10.1f} {p50 / base:9.2f}x {len(samples):7d}"


async def populate(
    idx: ResidencyIndex, tokens: list[int], nodes: int, bs: int, rng: random.Random
) -> None:
    n_blocks = len(tokens) // bs
    for i in range(nodes):
        node = NodeId(f"node-{i}")
        held = rng.randint(n_blocks // 8, n_blocks)
        events = [stored(tokens, 0, held, bs, "GPU")]
        if i % 3 == 0:
            events.append(stored(tokens, 0, rng.randint(1, held), bs, "CPU"))
        await idx.apply(node, EventBatch(0.0, tuple(events)))
    await idx.predict(NodeId("node-1"), BlockHasher("bench", bs).hash_tokens(tokens), 600)


async def bench(args: argparse.Namespace, url: str) -> None:
    rng = random.Random(args.seed)
    bs = args.block_size
    hasher = BlockHasher("bench", bs)
    tokens = [rng.randrange(128_000) for _ in range(args.blocks * bs)]
    prompt = hasher.hash_tokens(tokens)
    settings = RedisIndexSettings(
        url=url, namespace=f"bench-{uuid.uuid4().hex[:8]}", deadline_s=1.0, apply_deadline_s=30
    )
    memory, redis_idx = MemoryIndex(hasher), RedisIndex(hasher, settings)
    raw = Redis.from_url(url)
    try:
        for idx in (memory, redis_idx):
            await populate(idx, tokens, args.nodes, bs, random.Random(args.seed))
        assert await memory.match(prompt) == await redis_idx.match(prompt)
        print(f"match: {len(tokens)}-token prompt ({len(prompt)} blocks), {args.nodes} nodes")
        for node, m in sorted((await memory.match(prompt)).items()):
            print(f"  {node}: gpu {m.gpu} cpu {m.cpu} total {m.total} predicted {m.predicted}")
        budget = args.time_limit / 4
        ping = await timed(redis_idx.ping, args.repeat, budget)
        before = await _evalsha_stats(raw)
        redis_match = await timed(lambda: redis_idx.match(prompt), args.repeat, budget)
        after = await _evalsha_stats(raw)
        rows = {
            "redis PING round trip (baseline)": ping,
            "MemoryIndex.match": await timed(lambda: memory.match(prompt), args.repeat, budget),
            "RedisIndex.match": redis_match,
        }
        base = statistics.median(ping)
        print(f"{'case':42} {'p50 µs':>10} {'p99 µs':>10} {'x PING':>10} {'runs':>7}")
        for name, samples in rows.items():
            print(row(name, samples, base))
        calls = after[0] - before[0]
        if calls:
            server = (after[1] - before[1]) / calls
            print(f"  RedisIndex.match inside Redis (Lua, mean): {server:.1f} µs per call")

        # Apply throughput: fresh documents, event_blocks per BlockStored, pipelined batches.
        n_docs = max(1, args.apply_blocks // args.blocks)
        per = args.event_blocks
        per_doc: list[list[tuple[NodeId, EventBatch]]] = []
        for d in range(n_docs):
            doc = [rng.randrange(128_000) for _ in range(args.blocks * bs)]
            node = NodeId(f"node-{d % args.nodes}")
            per_doc.append([])
            for start in range(0, args.blocks, per):
                ev = stored(doc, start, min(start + per, args.blocks), bs, "GPU")
                per_doc[-1].append((node, EventBatch(0.0, (ev,))))
        # Interleaved as many workers publish at once (each worker's events stay in order).
        batches = [b for step in zip(*per_doc, strict=True) for b in step]
        total_blocks = sum(_blocks(b) for _, b in batches)
        stop = time.monotonic() + args.time_limit / 4
        t0 = time.perf_counter()
        done = events = 0
        writers: set[NodeId] = set()
        for i in range(0, len(batches), args.pipeline):
            chunk = batches[i : i + args.pipeline]
            await redis_idx.apply_many(chunk)
            done += sum(_blocks(b) for _, b in chunk)
            events += len(chunk)
            writers.update(node for node, _ in chunk)
            if time.monotonic() > stop:
                break
        elapsed = time.perf_counter() - t0
        redis_rate = done / elapsed
        t0 = time.perf_counter()
        for node, b in batches:
            await memory.apply(node, b)
        memory_rate = total_blocks / (time.perf_counter() - t0)
        # Baseline: the same number of plain HSETs, pipelined in the same chunk sizes.
        keys = [f"{{hset-baseline}}:{i}".encode() for i in range(done)]
        chunk_keys = args.pipeline * per
        t0 = time.perf_counter()
        for i in range(0, len(keys), chunk_keys):
            async with raw.pipeline(transaction=False) as pipe:
                for k in keys[i : i + chunk_keys]:
                    pipe.hset(k, "node-0|G", "1")
                await pipe.execute()
        hset_rate = len(keys) / (time.perf_counter() - t0)
        print(f"apply: {done} block events ({per} blocks/event, {args.pipeline} batches/pipeline)")
        print(f"  {'plain HSET pipelined (baseline)':40} {hset_rate:12,.0f} /s   1.00x")
        print(
            f"  {'RedisIndex.apply_many':40} {redis_rate:12,.0f} /s {redis_rate / hset_rate:6.2f}x"
        )
        print(f"  {'MemoryIndex.apply':40} {memory_rate:12,.0f} /s {memory_rate / hset_rate:6.2f}x")
        workers = len(writers)
        print(
            f"  one writer, events from {workers} workers: {events / elapsed:,.0f} event "
            f"batches/s into Redis ({per} blocks each)"
        )
        for i in range(0, len(keys), 10_000):
            await raw.delete(*keys[i : i + 10_000])
    finally:
        await raw.aclose()
        await memory.close()
        await redis_idx.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=512, help="blocks per prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2000, help="match calls per case")
    parser.add_argument("--apply-blocks", type=int, default=200_000)
    parser.add_argument("--event-blocks", type=int, default=64, help="blocks per BlockStored")
    parser.add_argument("--pipeline", type=int, default=16, help="batches per round trip")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds, roughly")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--redis-url", default=None, help="use this Redis instead of starting one (e.g. local)"
    )
    args = parser.parse_args()
    if args.redis_url:
        asyncio.run(bench(args, args.redis_url))
    else:
        with own_redis_server() as url:
            asyncio.run(bench(args, url))


if __name__ == "__main__":
    main()
