"""In-process simulated engines for the router-signal benchmarks (:mod:`loadtest.bench_signals`).

A :class:`SimEngine` has ``slots`` requests running at once (the rest wait, as in vLLM's
scheduler), an LRU prefix cache of ``capacity`` blocks, a prefill time per uncached token and a
fixed decode time. It can publish real KV events (ZMQ, vLLM's wire format) and serve a real
Prometheus ``/metrics`` page over HTTP with vLLM's series names, so the router under test runs
its real event feeds and its real scraper against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.events import BlockRemoved, BlockStored, EventBatch, EventPublisher
from kvtier.keys import BlockHash


@dataclass(frozen=True, slots=True)
class Served:
    ttft_s: float
    cached_tokens: int


class SimEngine:
    def __init__(
        self,
        name: str,
        *,
        slots: int,
        capacity_blocks: int,
        block_size: int,
        prefill_s_per_token: float,
        decode_s: float,
    ) -> None:
        self.name = name
        self.block_size = block_size
        self._capacity = capacity_blocks
        self._prefill = prefill_s_per_token
        self._decode = decode_s
        self._slots = asyncio.Semaphore(slots)
        self._cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.waiting = 0
        self.running = 0
        self.publisher: EventPublisher | None = None
        self.events_dropped = False
        """True: batches are no longer published (lost on the way, no gap ever seen)."""
        self._http: asyncio.Server | None = None
        self.url = ""

    # -- serving -------------------------------------------------------------------------------

    async def serve(
        self, tokens: Sequence[int], hashes: Sequence[BlockHash], decode_s: float | None = None
    ) -> Served:
        t0 = time.perf_counter()
        self.waiting += 1
        async with self._slots:
            self.waiting -= 1
            self.running += 1
            try:
                hit = 0
                while hit < len(hashes) and hashes[hit] in self._cache:
                    hit += 1
                hit = min(hit, (len(tokens) - 1) // self.block_size)  # last token is computed
                await asyncio.sleep((len(tokens) - hit * self.block_size) * self._prefill)
                ttft = time.perf_counter() - t0
                await self._store(tokens, hashes)
                await asyncio.sleep(self._decode if decode_s is None else decode_s)
            finally:
                self.running -= 1
        return Served(ttft, hit * self.block_size)

    async def _store(self, tokens: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        # Blocks another request evicted during this prefill are stored again.
        missing = [i for i, h in enumerate(hashes) if h not in self._cache]
        first = missing[0] if missing else len(hashes)
        new = list(hashes[first:])
        # Touch deepest first so that a chain's parents stay more recent than its children.
        for h in reversed(hashes):
            self._cache[h] = None
            self._cache.move_to_end(h)
        evicted: list[BlockHash] = []
        while len(self._cache) > self._capacity:
            h, _ = self._cache.popitem(last=False)
            evicted.append(h)
        if self.publisher is None or self.events_dropped:
            return
        events: list[BlockStored | BlockRemoved] = []
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "GPU"))
        if new:
            bs = self.block_size
            events.append(
                BlockStored(
                    tuple(new),
                    hashes[first - 1] if first > 0 else None,
                    tuple(tokens[first * bs : len(hashes) * bs]),
                    bs,
                    None,
                    "GPU",
                )
            )
        if events:
            await self.publisher.publish(EventBatch(time.time(), tuple(events)))

    # -- KV events and /metrics ----------------------------------------------------------------

    async def start_events(self) -> tuple[str, str]:
        self.publisher = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        await self.publisher.start()
        assert self.publisher.replay_endpoint is not None
        return self.publisher.endpoint, self.publisher.replay_endpoint

    def metrics_page(self) -> bytes:
        labels = f'{{engine="0",model_name="{self.name}"}}'
        used = len(self._cache) / self._capacity if self._capacity else 0.0
        return (
            f"# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {self.waiting}.0\n"
            f"# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {self.running}.0\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {used:.3f}\n"
        ).encode()

    async def start_metrics(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    body = self.metrics_page()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n")
                    writer.write(b"content-length: %d\r\n\r\n" % len(body) + body)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self._http = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._http.sockets[0].getsockname()[1]}"
        return self.url

    async def close(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
        if self._http is not None:
            self._http.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._http.wait_closed(), 1.0)
