"""Residency demo: KV events from two fake engines feed an index; the router asks who holds what.

    python -m kvtier.demo [--block-size 16] [--blocks 32] [--seed 0]

Each fake engine runs a real :class:`kvtier.events.EventPublisher` on a loopback port and hashes
blocks its own way (not the router's). A :class:`kvtier.events.EventSubscriber` per engine feeds
a :class:`kvtier.residency.MemoryIndex`; engine ``node-a`` publishes part of its history before
the router subscribes, so that part arrives by replay. The demo prints, for one prompt, each
node's matched prefix per tier, then the subscribers' counters. It takes about a second and
exits 0 when every published batch reached the index.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

from kvtier.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    EventSubscriber,
    Medium,
)
from kvtier.keys import BlockHasher
from kvtier.residency import Match, MemoryIndex, NodeId


class FakeEngine:
    """Publishes vLLM-shaped events; its block hashes come from a seed the router never sees."""

    def __init__(self, node: NodeId, block_size: int) -> None:
        self.node = node
        self.block_size = block_size
        self._own = BlockHasher(f"engine-private-seed:{node}", block_size)
        self.publisher = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")

    def _hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return list(self._own.hash_tokens(tokens))

    async def store(self, tokens: Sequence[int], start: int, end: int, medium: Medium) -> None:
        hashes = self._hashes(tokens)
        bs = self.block_size
        event = BlockStored(
            block_hashes=tuple(hashes[start:end]),
            parent_block_hash=hashes[start - 1] if start else None,
            token_ids=tuple(tokens[start * bs : end * bs]),
            block_size=bs,
            medium=medium.value,
        )
        await self.publisher.publish(EventBatch(time.time(), (event,)))

    async def evict(self, tokens: Sequence[int], blocks: Sequence[int], medium: Medium) -> None:
        hashes = self._hashes(tokens)
        event = BlockRemoved(tuple(hashes[b] for b in blocks), medium.value)
        await self.publisher.publish(EventBatch(time.time(), (event,)))


def _describe(match: Match | None, n_blocks: int) -> str:
    if match is None:
        return f"nothing of {n_blocks} blocks"
    return (
        f"gpu {match.gpu:3d}  cpu {match.cpu:3d}  any tier {match.total:3d}  "
        f"with predictions {match.predicted:3d}  (of {n_blocks} blocks)"
    )


async def _until(cond: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def run(block_size: int, blocks: int, seed: int) -> int:
    rng = random.Random(seed)
    system = [rng.randrange(32_000) for _ in range(blocks // 2 * block_size)]
    chat = system + [rng.randrange(32_000) for _ in range((blocks - blocks // 2) * block_size)]
    hasher = BlockHasher("demo-model", block_size)
    index = MemoryIndex(hasher)
    engines = {n: FakeEngine(n, block_size) for n in (NodeId("node-a"), NodeId("node-b"))}
    subscribers: list[EventSubscriber] = []
    try:
        for engine in engines.values():
            await engine.publisher.start()
        a, b = engines[NodeId("node-a")], engines[NodeId("node-b")]
        # Before the router subscribes: node-a computes the whole chat (it will come by replay).
        await a.store(chat, 0, blocks // 4, Medium.GPU)
        await a.store(chat, blocks // 4, blocks, Medium.GPU)

        def feed(node: NodeId) -> Callable[[EventBatch], Awaitable[None]]:
            return lambda batch: index.apply(node, batch)

        def reset(node: NodeId) -> Callable[[], Awaitable[None]]:
            return lambda: index.forget(node)

        for node, engine in engines.items():
            sub = EventSubscriber(
                engine.publisher.endpoint,
                engine.publisher.replay_endpoint,
                topic="kv",
                on_batch=feed(node),
                on_reset=reset(node),
                name=node,
            )
            subscribers.append(sub)
            await sub.start()
        await asyncio.sleep(0.1)  # let the SUB connections settle before live events
        # Live: node-a offloads the first half to CPU, then its GPU evicts the tail;
        # node-b holds only the system prompt.
        await a.store(chat, 0, blocks // 2, Medium.CPU)
        await a.evict(chat, range(blocks * 3 // 4, blocks), Medium.GPU)
        await b.store(system, 0, len(system) // block_size, Medium.GPU)
        # The router just sent a request to node-b: it predicts the rest will be there soon.
        prompt = hasher.hash_tokens(chat)
        await index.predict(NodeId("node-b"), prompt, ttl_s=2.0)

        published = [e.publisher.next_seq for e in engines.values()]
        delivered = await _until(
            lambda: [s.next_seq for s in subscribers] == published, within_s=5.0
        )
        result = await index.match(prompt)
        print(f"prompt: {len(chat)} tokens, {len(prompt)} blocks of {block_size}")
        for node in engines:
            print(f"  {node}: {_describe(result.get(node), len(prompt))}")
        for node, sub in zip(engines, subscribers, strict=True):
            s = sub.stats
            print(
                f"  events from {node}: delivered {s.delivered} (live {s.received}, "
                f"replayed {s.replayed}), gaps {s.gaps}, malformed {s.malformed}, "
                f"resets {s.resets}"
            )
        if not delivered:
            print("not every published batch reached the index in time", file=sys.stderr)
            return 1
        return 0
    finally:
        for sub in subscribers:
            await sub.close()
        for engine in engines.values():
            await engine.publisher.close()
        await index.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.demo", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--blocks", type=int, default=32, help="blocks in the demo prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    args = parser.parse_args(argv)
    if args.blocks < 4 or args.block_size < 1:
        parser.error("need --blocks >= 4 and --block-size >= 1")
    sys.exit(asyncio.run(run(args.block_size, args.blocks, args.seed)))


if __name__ == "__main__":
    main()
