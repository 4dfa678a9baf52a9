"""Scenario 5: Redis slowed, black-holed, paused, stopped and restarted under the KV router.

The proxy's KV router keeps residency in a real redis-server, reached through a loopback relay
that can delay or stall its traffic. Client requests flow at steady concurrency through every
phase; none may fail, the router falls back to load-only routing while Redis misbehaves (its
``shared_state_up`` gauge drops, its fallback counter grows), adds little latency while doing
so (median added latency within ``_FALLBACK_BUDGET_S``), and recovers by itself afterwards.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time
from collections.abc import Callable

import httpx
import pytest

from tests.conftest import RedisServer

from .faults import TcpRelay
from .procs import ProcessGroup
from .proxy_client import ask, backend, gauges
from .record import Tally

pytestmark = [pytest.mark.slow, pytest.mark.redis]

_FALLBACK_BUDGET_S = 0.1
_PHASE_S = 2.0


def _dbsize(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"DBSIZE\r\n")
        answer = s.recv(64)
    return int(answer.strip().lstrip(b":")) if answer.startswith(b":") else 0


async def test_proxy_kv_router_survives_redis_faults(
    procs: ProcessGroup, own_redis: RedisServer, tally: Tally
) -> None:
    producer = procs.worker("p", role="producer", events=True, wait=False)
    consumer = procs.worker("d", role="consumer", events=True, wait=False)
    producer.wait_healthy()
    consumer.wait_healthy()
    async with TcpRelay(own_redis.port) as relay, httpx.AsyncClient(timeout=30) as client:
        proxy = procs.proxy(
            "proxy",
            {
                "router": "kv",
                "router_options": {
                    "index_url": f"redis://127.0.0.1:{relay.port}/0",
                    "model_seed": "kvtier-sim/seed=0",
                    "block_size": 16,
                    "redis_deadline_s": 0.02,
                    "breaker_failures": 2,
                    "breaker_cooldown_s": 0.3,
                },
                "backends": [
                    {
                        **backend("p", producer.url, "producer"),
                        "events_endpoint": producer.events_endpoint,
                    },
                    {
                        **backend("d", consumer.url, "consumer"),
                        "events_endpoint": consumer.events_endpoint,
                    },
                ],
                "health": {"enabled": False},
            },
        )
        latencies: dict[str, list[float]] = {}
        phase = "baseline"
        stop = asyncio.Event()

        async def lane(k: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                body = {
                    "prompt": f"Group {i % 3} shares this prefix with its peers. " * 6
                    + f"#{k}-{i}",
                    "max_tokens": 3,
                    "temperature": 0,
                }
                try:
                    a = await ask(client, proxy.url, body)
                except (AssertionError, httpx.HTTPError) as exc:
                    tally.fail(f"{phase}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                if a.status != 200:
                    tally.fail(f"{phase}: status {a.status}")
                    continue
                tally.ok(fallback=phase not in ("baseline", "recovered"))
                latencies.setdefault(phase, []).append(a.elapsed_s)

        async def hold(name: str, start: Callable[[], None], end: Callable[[], None]) -> None:
            nonlocal phase
            start()
            phase = name
            try:
                await asyncio.sleep(_PHASE_S)
            finally:
                end()
                phase = "recovering"
                await asyncio.sleep(0.5)

        def slow() -> None:
            relay.delay_s = 0.2

        def fast() -> None:
            relay.delay_s = 0.0

        def stall() -> None:
            relay.stalled = True

        def unstall() -> None:
            relay.stalled = False
            relay.cut()  # the stalled connections are out of sync now

        lanes = [asyncio.create_task(lane(k)) for k in range(4)]
        try:
            await asyncio.sleep(_PHASE_S)
            await hold("slow redis (200 ms per chunk)", slow, fast)
            await hold("black-holed redis", stall, unstall)
            await hold("paused redis (SIGSTOP)", own_redis.pause, own_redis.resume)
            await hold("stopped redis", own_redis.stop, own_redis.start)
            phase = "recovered"
            restarted = time.monotonic()
            # Redis came back empty (no persistence): the router writing residency and
            # predictions into it again is what recovery means.
            recovered_in = None
            while time.monotonic() - restarted < 10:
                if await asyncio.to_thread(_dbsize, own_redis.port) > 0:
                    recovered_in = time.monotonic() - restarted
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            await asyncio.gather(*lanes)
        g = await gauges(client, proxy)
    base = statistics.median(latencies["baseline"])
    summary = []
    for name, values in latencies.items():
        summary.append(f"{name}: n={len(values)} median {statistics.median(values) * 1000:.0f} ms")
    tally.notes.append("; ".join(summary))
    if recovered_in is not None:
        tally.notes.append(f"router wrote to the restarted Redis after {recovered_in:.2f} s")
    assert tally.failed == 0, tally.notes
    assert recovered_in is not None, "the router never used Redis again after it came back"
    if "pdproxy_kv_router_shared_state_up" in g:
        fallbacks = g.get("pdproxy_kv_router_fallbacks_total", 0.0)
        tally.notes.append(f"{fallbacks:.0f} routing decisions by load alone (router fallback)")
        assert g["pdproxy_kv_router_shared_state_up"] == 1.0
        assert g.get("pdproxy_kv_router_fallbacks_total", 0.0) > 0, "no load-only fallback seen"
    else:
        tally.notes.append("KV router metrics are not on the proxy's /metrics (reported)")
    for name in ("black-holed redis", "paused redis (SIGSTOP)", "stopped redis"):
        values = latencies.get(name, [])
        assert values, f"no request completed while {name}"
        added = statistics.median(values) - base
        assert added <= _FALLBACK_BUDGET_S, f"{name}: median +{added * 1000:.0f} ms"
    assert latencies.get("recovered"), "no request after recovery"
