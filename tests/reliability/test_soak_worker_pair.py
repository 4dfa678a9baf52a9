"""Bounded soak of a producer + consumer pair: streaming PD requests with random disconnects.

The test plays the proxy (DESIGN §3): producer leg, then a streamed consumer leg, at steady
concurrency. A seeded random share of clients go away: during the producer leg, between the
legs (the proxy then releases the supply), or mid-stream. Afterwards both workers must be back
at their idle baseline: no request, supply, device or host page left held, asyncio tasks and
fds within a few of the baseline, RSS growth under the stated tolerance.

Default: ~20 s (CI). ``python -m loadtest.reliability --long``: 5 minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest

from .legs import producer_leg
from .procs import ProcessGroup, WorkerProcess
from .record import Tally, long_mode
from .resources import Tolerance, WorkerSample, sample_worker, settle

pytestmark = pytest.mark.slow

# A consumer keeps up to 8 idle P2P sessions per producer (kvtier.p2p max_sessions_per_peer);
# each is a socket on both ends and a task on the producer: pooled, bounded, not leaked.
_TOLERANCE = Tolerance(rss_bytes=48 * 2**20, fds=12, tasks=12)
_PREFIXES = [f"Shared system prompt number {i}: be brief and exact. " * 4 for i in range(4)]


@dataclass
class _Soak:
    producer: WorkerProcess
    consumer: WorkerProcess
    client: httpx.AsyncClient
    rng: random.Random
    tally: Tally
    disconnects: int = 0

    async def one(self, i: int) -> None:
        prompt = self.rng.choice(_PREFIXES) + f"question {i} " * self.rng.randint(1, 6)
        body = {"prompt": prompt, "max_tokens": self.rng.randint(4, 24), "temperature": 0}
        fate = self.rng.random()
        if fate < 0.1:  # client gone during the producer leg
            await self._abandon_producer_leg(body)
            return
        supply = await producer_leg(self.client, self.producer.url, body)
        if fate < 0.2:  # client gone between the legs: the proxy releases the supply
            await self._release(supply.kv_request_id)
            self.disconnects += 1
            self.tally.ok()
            return
        stop_after = self.rng.randint(1, 4) if fate < 0.45 else None
        chunks = 0
        params = supply.consumer_params()
        async with self.client.stream(
            "POST",
            f"{self.consumer.url}/v1/completions",
            json={**body, "stream": True, "kv_transfer_params": params},
        ) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                assert '"error"' not in line, line
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    break  # client gone mid-stream: closing the response drops the connection
        if stop_after is not None:
            self.disconnects += 1
        else:
            assert chunks > 0
        self.tally.ok()

    async def _abandon_producer_leg(self, body: dict[str, object]) -> None:
        kv_request_id = uuid.uuid4().hex  # chosen by the proxy, so it can release it
        task = asyncio.create_task(
            producer_leg(self.client, self.producer.url, body, kv_request_id)
        )
        await asyncio.sleep(self.rng.uniform(0.0, 0.05))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self._release(kv_request_id)
        self.disconnects += 1
        self.tally.ok()

    async def _release(self, kv_request_id: str) -> None:
        resp = await self.client.post(
            f"{self.producer.url}/v1/kv/release", json={"kv_request_id": kv_request_id}
        )
        assert resp.status_code == 200


async def _run(soak: _Soak, duration_s: float, concurrency: int, max_requests: int) -> None:
    counter = iter(range(max_requests))
    deadline = time.monotonic() + duration_s

    async def lane() -> None:
        for i in counter:
            if time.monotonic() > deadline:
                return
            try:
                async with asyncio.timeout(30):
                    await soak.one(i)
            except (AssertionError, httpx.HTTPError, TimeoutError) as exc:
                soak.tally.fail(f"{type(exc).__name__}: {str(exc)[:160]}")

    await asyncio.gather(*(lane() for _ in range(concurrency)))


def _leaks(name: str, proc: WorkerProcess, base: WorkerSample) -> list[str]:
    _, leaks = settle(proc.url, proc.pid, base, _TOLERANCE, timeout_s=15)
    return [f"{name}: {leak}" for leak in leaks]


async def test_soak_pd_pair_streaming_with_disconnects(procs: ProcessGroup, tally: Tally) -> None:
    latency = ["--sim-prefill-ms-per-token", "0.02", "--sim-decode-ms-per-step", "4"]
    producer = procs.worker("soak-producer", role="producer", args=latency, wait=False)
    consumer = procs.worker("soak-consumer", role="consumer", args=latency, wait=False)
    producer.wait_healthy()
    consumer.wait_healthy()
    duration_s, concurrency = (300.0, 16) if long_mode() else (15.0, 8)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        soak = _Soak(producer, consumer, client, random.Random(1234), tally)
        await _run(soak, 3.0, concurrency, 40)  # warm-up: allocator, prefix caches, sessions
        _leaks("warm-up producer", producer, sample_worker(producer.url, producer.pid))
        p_base = sample_worker(producer.url, producer.pid)
        c_base = sample_worker(consumer.url, consumer.pid)
        warm = (tally.sent, tally.failed)
        tally.sent = tally.succeeded = tally.failed = 0
        tally.notes.clear()
        await _run(soak, duration_s, concurrency, 100_000)
    leaks = _leaks("producer", producer, p_base) + _leaks("consumer", consumer, c_base)
    tally.leaks.extend(leaks)
    tally.notes.append(
        f"{duration_s:.0f} s at concurrency {concurrency}; {soak.disconnects} disconnects; "
        f"warm-up {warm[0]} requests ({warm[1]} failed)"
    )
    assert tally.failed == 0, tally.notes
    assert tally.sent >= concurrency * 4, "the soak made too few requests to mean anything"
    assert soak.disconnects > 0
    assert not leaks, leaks
