"""Hostile upstreams behind a real proxy process: no client ever gets another client's bytes.

Scenario A: a NIXL producer and a consumer that send interim (1xx) responses before every
answer and an unsolicited extra response right behind it (glued to it or in its own write),
while four clients send streamed and plain completions concurrently and health checks run.
Every answer must be the client's own (``answer-for-<its prompt>``): no ``INJECTED`` bytes, no
other client's prompt, no producer params of another request reaching the consumer.

Scenario B: a producer whose heads are far past the proxy's head cap, and a consumer that ends
its bodies by closing the connection (no content-length, no chunking). The oversized producer
legs fail fast (typed error, consumer-only fallback), the close-delimited bodies arrive whole.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .hostile_upstream import INJECTED, HostileEngine, HostileModes
from .procs import ProcessGroup
from .proxy_client import backend
from .record import Tally

pytestmark = pytest.mark.slow

_INTERIM = (
    b"HTTP/1.1 100 Continue\r\n\r\n"
    b"HTTP/1.1 103 Early Hints\r\nlink: </x.css>; rel=preload\r\nx-leak: interim\r\n\r\n"
)


def _config(producer: HostileEngine, consumer: HostileEngine, *, health: bool) -> dict[str, object]:
    return {
        "router": "round_robin",
        "backends": [
            backend("p", producer.url, "producer", dialect="nixl"),
            backend("d", consumer.url, "consumer", dialect="nixl"),
        ],
        "health": {"enabled": health, "interval_s": 0.2},
        "timeouts": {"connect_s": 1.0, "producer_total_s": 5.0, "consumer_first_byte_s": 5.0},
        "retries": {"producer_attempts": 1, "consumer_attempts": 1, "backoff_base_s": 0.001},
        "breaker": {"failure_threshold": 1000},
    }


async def _clients(url: str, n: int, tally: Tally) -> list[str]:
    """``n`` requests from 4 concurrent clients; returns the prompts that got a wrong answer."""
    wrong: list[str] = []
    sem = asyncio.Semaphore(4)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        prompt = f"client{i:04d}-secret"
        body = {"model": "m", "prompt": prompt, "max_tokens": 4, "stream": i % 2 == 0}
        async with sem:
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                tally.fail(f"{type(exc).__name__}: {exc}")
                return
        raw = r.content
        others = raw.replace(prompt.encode(), b"")
        if r.status_code != 200:
            tally.fail(f"status {r.status_code}: {raw[:120]!r}")
        elif f"answer-for-{prompt}".encode() not in raw or INJECTED in raw or b"MISMATCH" in raw:
            wrong.append(prompt)
            tally.fail(f"{prompt} got {raw[:160]!r}")
        elif b"client" in others:
            wrong.append(prompt)
            tally.fail(f"{prompt} got another client's bytes: {raw[:160]!r}")
        else:
            tally.ok(fallback="x-pdproxy-fallback" in r.headers)

    async with httpx.AsyncClient(timeout=30) as c1, httpx.AsyncClient(timeout=30) as c2:
        await asyncio.gather(*(one(i, (c1, c2)[i % 2]) for i in range(n)))
    return wrong


async def test_proxy_upstream_1xx_and_stray_bytes_no_cross_client_bytes(
    procs: ProcessGroup, tally: Tally
) -> None:
    modes = HostileModes(interim=_INTERIM, stray=True)
    async with HostileEngine("p", True, modes) as p, HostileEngine("d", False, modes) as d:
        proxy = procs.proxy("proxy", _config(p, d, health=True))
        wrong = await _clients(proxy.url, 64, tally)
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"{proxy.url}/health")).status_code == 200
            ready = (await client.get(f"{proxy.url}/ready")).status_code
    tally.notes.append(
        f"upstream connections: producer {p.connections} for {p.requests} requests, "
        f"consumer {d.connections} for {d.requests} (every stray closes one)"
    )
    assert wrong == [], tally.notes
    assert tally.failed == 0, tally.notes
    assert tally.fallback == 0, "interim answers and strays must not fail a leg"
    assert ready == 200, "health checks through 1xx and strays must keep backends healthy"


async def test_proxy_upstream_oversized_heads_and_close_delimited_bodies(
    procs: ProcessGroup, tally: Tally
) -> None:
    padding = b"".join(b"x-pad-%d: %s\r\n" % (i, b"p" * 1000) for i in range(80))  # ~80 KiB
    huge = HostileModes(head_padding=padding)
    closing = HostileModes(close_delimited=True)
    async with HostileEngine("p", True, huge) as p, HostileEngine("d", False, closing) as d:
        # No health checks: they would eject the producer, and every leg is to be tried.
        proxy = procs.proxy("proxy", _config(p, d, health=False))
        wrong = await _clients(proxy.url, 24, tally)
    tally.notes.append(f"consumer connections {d.connections} for {d.requests} requests")
    assert wrong == [], tally.notes
    assert tally.failed == 0, tally.notes
    # Every producer leg is refused (head past 64 KiB): each request is served by the consumer
    # alone; non-stream answers were close-delimited and arrived whole.
    assert tally.fallback == tally.succeeded == 24
