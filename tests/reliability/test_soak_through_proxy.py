"""Bounded soak of the whole stack: clients → pdproxy → producer + consumer, with disconnects.

Steady concurrency of streaming and non-streaming clients, a seeded share of which leave at a
random moment (before the answer, mid-stream). Afterwards the workers must be back at their idle
baseline (requests, supplies, device and host pages, tasks, fds, RSS within tolerance) and so
must the proxy (no request in flight on any backend, empty admission queue, fds and RSS within
tolerance).

Default: ~12 s (CI). ``python -m loadtest.reliability --long``: 5 minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import httpx
import pytest

from .procs import ManagedProcess, ProcessGroup
from .proxy_client import backend, gauges
from .record import Tally, long_mode
from .resources import Tolerance, open_fds, rss_bytes, sample_worker, settle

pytestmark = pytest.mark.slow

_TOLERANCE = Tolerance(rss_bytes=48 * 2**20, fds=12, tasks=12)
_PROXY_RSS_BYTES = 48 * 2**20
_PROXY_FDS = 12


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, i: int) -> str:
    """One client; returns how it ended (``done``, ``left early``)."""
    body = {
        "prompt": f"Prefix {i % 5} of the soak, shared by many requests. " * 4 + f"#{i}",
        "max_tokens": rng.randint(4, 20),
        "temperature": 0,
        "stream": rng.random() < 0.7,
    }
    leave_after = rng.uniform(0.0, 0.3) if rng.random() < 0.35 else None

    async def run() -> None:
        if body["stream"]:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                raw = b"".join([chunk async for chunk in resp.aiter_bytes()])
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
            assert b'"error"' not in raw, raw[-300:]
        else:
            resp = await client.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] is not None

    if leave_after is None:
        await run()
        return "done"
    task = asyncio.create_task(run())
    done, _ = await asyncio.wait({task}, timeout=leave_after)
    if done:
        task.result()
        return "done"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return "left early"


def _proxy_sample(proxy: ManagedProcess) -> tuple[int, int]:
    return rss_bytes(proxy.pid), open_fds(proxy.pid)


async def test_soak_through_proxy(procs: ProcessGroup, tally: Tally) -> None:
    latency = ["--sim-prefill-ms-per-token", "0.02", "--sim-decode-ms-per-step", "5"]
    producer = procs.worker("p", role="producer", args=latency, wait=False)
    consumer = procs.worker("d", role="consumer", args=latency, wait=False)
    producer.wait_healthy()
    consumer.wait_healthy()
    proxy = procs.proxy(
        "proxy",
        {
            "backends": [
                backend("p", producer.url, "producer"),
                backend("d", consumer.url, "consumer"),
            ],
            "health": {"enabled": False},
        },
    )
    duration_s, concurrency = (300.0, 16) if long_mode() else (12.0, 8)
    rng = random.Random(4321)
    left_early = 0
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as client:

        async def lanes(seconds: float, limit: int) -> None:
            nonlocal left_early
            counter = iter(range(limit))
            deadline = time.monotonic() + seconds

            async def lane() -> None:
                nonlocal left_early
                for i in counter:
                    if time.monotonic() > deadline:
                        return
                    try:
                        async with asyncio.timeout(30):
                            how = await _one(client, proxy.url, rng, i)
                    except (AssertionError, httpx.HTTPError, TimeoutError) as exc:
                        tally.fail(f"{type(exc).__name__}: {str(exc)[:160]}")
                        continue
                    left_early += how == "left early"
                    tally.ok()

            await asyncio.gather(*(lane() for _ in range(concurrency)))

        await lanes(2.0, 30)  # warm-up
        await asyncio.sleep(0.5)
        p_base = sample_worker(producer.url, producer.pid)
        c_base = sample_worker(consumer.url, consumer.pid)
        x_rss, x_fds = _proxy_sample(proxy)
        tally.sent = tally.succeeded = tally.failed = 0
        left_early = 0
        await lanes(duration_s, 1_000_000)
        leaks: list[str] = []
        for name, w, base in (("producer", producer, p_base), ("consumer", consumer, c_base)):
            _, found = settle(w.url, w.pid, base, _TOLERANCE, timeout_s=15)
            leaks += [f"{name}: {leak}" for leak in found]
        g = await gauges(client, proxy)
        in_flight = sum(v for k, v in g.items() if k.startswith("pdproxy_backend_in_flight"))
        if in_flight:
            leaks.append(f"proxy: {in_flight:.0f} requests still in flight on backends")
        if g.get("pdproxy_queue_depth", 0.0):
            leaks.append("proxy: admission queue not empty")
        rss, fds = _proxy_sample(proxy)
        if rss - x_rss > _PROXY_RSS_BYTES:
            leaks.append(f"proxy: rss +{(rss - x_rss) / 2**20:.1f} MiB")
        if fds - x_fds > _PROXY_FDS:
            leaks.append(f"proxy: fds {x_fds}->{fds}")
    tally.leaks.extend(leaks)
    tally.notes.append(
        f"{duration_s:.0f} s at concurrency {concurrency}; {left_early} clients left early; "
        f"proxy rss {(rss - x_rss) / 2**20:+.1f} MiB, fds {x_fds}->{fds}"
    )
    assert tally.failed == 0, tally.notes
    assert left_early > 0 and tally.sent >= concurrency * 4
    assert not leaks, leaks
