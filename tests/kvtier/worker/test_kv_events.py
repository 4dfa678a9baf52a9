"""Residency events over ZMQ: device (GPU) and host-tier (CPU) stores and removals."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from kvtier.events import BlockRemoved, BlockStored, KVEvent, decode_batch
from kvtier.keys import BlockHasher

from .pd_helpers import pd_request, workers

PROMPT = "Events say where each block lives, per medium. " * 3  # 141 tokens, 8 full blocks


async def collect(sub: zmq.asyncio.Socket, until: int, timeout_s: float = 5.0) -> list[KVEvent]:
    events: list[KVEvent] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(events) < until and loop.time() < deadline:
        if await sub.poll(timeout=50):
            _topic, seq, payload = await sub.recv_multipart()
            assert len(seq) == 8
            events.extend(decode_batch(payload).events)
    return events


async def test_producer_publishes_gpu_and_cpu_stores_with_router_hashes() -> None:
    overrides = {"events_endpoint": "tcp://127.0.0.1:*", "num_pages": 40}
    async with workers("sim", "producer", "consumer", **overrides) as (producer, consumer):
        publisher = producer.worker.events.publisher
        consumer_publisher = consumer.worker.events.publisher
        assert publisher is not None and consumer_publisher is not None
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        consumer_sub = ctx.socket(zmq.SUB)
        for socket, endpoint in (
            (sub, publisher.endpoint),
            (consumer_sub, consumer_publisher.endpoint),
        ):
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(endpoint)
        try:
            await asyncio.sleep(0.2)  # PUB/SUB slow joiner
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
            await pd_request(producer, consumer, body, "p2p")
            events = await collect(sub, until=2)
            stored = [e for e in events if isinstance(e, BlockStored)]
            by_medium = {e.medium: e for e in stored}
            assert set(by_medium) >= {"GPU", "CPU"}
            hasher = BlockHasher(producer.worker.settings.hash_seed)
            tokens = list(PROMPT.encode())
            expected = hasher.hash_tokens(tokens)
            gpu = by_medium["GPU"]
            assert list(gpu.block_hashes) == expected[: len(gpu.block_hashes)]
            assert len(gpu.block_hashes) == len(expected)
            assert list(gpu.token_ids) == tokens[: 16 * len(expected)]
            assert gpu.parent_block_hash is None and gpu.block_size == 16
            cpu_hashes = [h for e in stored if e.medium == "CPU" for h in e.block_hashes]
            assert sorted(cpu_hashes) == sorted(expected)
            # The consumer: fetched blocks land in its host tier (CPU), then on its device (GPU).
            fetched = [
                e for e in await collect(consumer_sub, until=2) if isinstance(e, BlockStored)
            ]
            consumer_media = {e.medium for e in fetched}
            assert consumer_media >= {"GPU", "CPU"}
            cap = (len(tokens) - 1) // 16
            consumer_cpu = {h for e in fetched if e.medium == "CPU" for h in e.block_hashes}
            assert consumer_cpu == set(expected[:cap])
            # Filling the device cache with other prompts evicts these blocks: GPU removals.
            for i in range(3):
                other = {"prompt": f"{i} other text to push blocks out. " * 8, "max_tokens": 1}
                await producer.client.post("/v1/completions", json=other)
            later = await collect(sub, until=50, timeout_s=1.0)
            removed = [
                h
                for e in later
                if isinstance(e, BlockRemoved) and e.medium == "GPU"
                for h in e.block_hashes
            ]
            assert set(removed) & set(expected)
        finally:
            sub.close()
            consumer_sub.close()
            ctx.term()
