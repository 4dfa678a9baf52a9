"""Connection-slot exhaustion against a real ``pdproxy serve`` (issue 30 finding 1).

The attacker holds no key: it only opens TCP connections and says nothing, or dribbles a
request head that never ends, or sends an endless head. Before the fix, 4,096 silent sockets
filled ``max_connections`` (uvicorn's ``limit_concurrency``) and every keyed client got 503 for
as long as they were held. Now a connection counts against ``max_connections`` only while a
request is in progress; one without a complete head is closed after ``head_timeout_s``; those
waiting for a head have their own budget (the oldest closed first) and a per-source one; a head
is at most ``max_head_bytes``.

Each attacker source is its own loopback address (127.0.0.2, ...), the legitimate client
127.0.0.1, so the per-source cap is seen as behind no load balancer. Figures (legit success
rate, RSS, ``/health`` max latency) go to the scenario's notes; the bounds are generous.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from loadtest.fake_backend import FakeBackend

from .attackers import HeldSockets, group_rss, port_of
from .procs import ProcessGroup
from .proxy_client import backend
from .record import Tally

pytestmark = pytest.mark.slow

_MiB = 2**20
_KEY = "legit-client-key-0123456789abcdef"


async def _poll_health(
    url: str, stop: asyncio.Event, samples: list[float], refused: list[int]
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            started = time.monotonic()
            r = await client.get(f"{url}/health")
            if r.status_code != 200:
                refused.append(r.status_code)
            samples.append(time.monotonic() - started)
            await asyncio.sleep(0.05)


async def _legit(url: str, n: int, tally: Tally, gap_s: float = 0.2) -> None:
    """``n`` keyed completions, each on a fresh connection (as many separate clients)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    headers = {"authorization": f"Bearer {_KEY}"}
    async with httpx.AsyncClient(timeout=20, limits=limits, headers=headers) as client:
        for i in range(n):
            try:
                r = await client.post(f"{url}/v1/completions", json={"prompt": f"legit {i}"})
            except httpx.HTTPError as exc:
                tally.fail(f"legit request {i}: {type(exc).__name__}")
            else:
                if r.status_code == 200:
                    tally.ok()
                else:
                    tally.fail(f"legit request {i}: {r.status_code}")
            await asyncio.sleep(gap_s)


async def test_silent_sockets_do_not_lock_keyed_clients_out(
    procs: ProcessGroup, tally: Tally
) -> None:
    """4x ``max_connections`` silent or dribbling sockets from one source, re-opened as the
    proxy closes them: every keyed request still succeeds and every attacker socket is closed
    within a few seconds of opening (default ``head_timeout_s``)."""
    d = FakeBackend("D")
    async with d:
        config = {
            "backends": [backend("D", d.url, "consumer", "nixl")],
            "health": {"enabled": False},
            "api_keys": [{"key": _KEY}],
            "admission": {"max_connections": 64},
            "workers": 2,  # the default on this 2-core machine: one per core
        }
        proxy = procs.proxy("proxy", config)
        base = group_rss(proxy)
        attack = HeldSockets(port_of(proxy), ["127.0.0.2"])
        cap = 4 * 64
        attack.open(cap, dribbling=cap // 4)
        for _ in range(100):  # bounded: 10 s for the kernel to hand them all over
            if attack.opened >= cap:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        held_at_start = attack.held
        samples: list[float] = []
        refused: list[int] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_health(proxy.url, stop, samples, refused))
        refill_stop = asyncio.Event()

        async def refill() -> None:
            """Keep ``cap`` sockets open: re-open each one the proxy closes (bounded)."""
            for _ in range(200):
                if refill_stop.is_set() or attack.opened >= 6 * cap:
                    return
                missing = cap - len(attack.tasks)
                if missing > 0:
                    attack.open(missing)
                await asyncio.sleep(0.05)

        refiller = asyncio.create_task(refill())
        peak = base
        try:
            legit = asyncio.create_task(_legit(proxy.url, 30, tally))
            while not legit.done():
                peak = max(peak, group_rss(proxy))
                await asyncio.sleep(0.2)
            await legit
        finally:
            refill_stop.set()
            await refiller
            stop.set()
            await poller
        # Every attacker socket still open is closed by the proxy within its head deadline.
        for _ in range(200):  # bounded: 20 s
            if not attack.tasks:
                break
            await asyncio.sleep(0.1)
        still_open = len(attack.tasks)
        await attack.stop()
        after = group_rss(proxy)
    worst = max(samples)
    lifetimes = sorted(attack.lifetimes) or [float("inf")]
    tally.notes.append(
        f"{held_at_start} attacker sockets held (cap 64, 1/4 dribbling a head), "
        f"{attack.opened} opened in all: legit {tally.succeeded}/{tally.sent} succeeded; "
        f"attacker sockets closed after median {lifetimes[len(lifetimes) // 2]:.1f} s, "
        f"max {lifetimes[-1]:.1f} s; /health max {worst * 1000:.0f} ms over {len(samples)} "
        f"probes ({len(refused)} refused); RSS {base / _MiB:.0f} -> {peak / _MiB:.0f} (peak) "
        f"-> {after / _MiB:.0f} MiB"
    )
    print(tally.notes[-1])
    assert held_at_start >= 64, tally.notes  # the attack did hold more sockets than the cap
    assert tally.failed == 0 and tally.succeeded == 30, tally.notes
    assert not refused, tally.notes
    assert still_open == 0, f"{still_open} attacker sockets never closed; {tally.notes}"
    assert lifetimes[-1] < 15.0, tally.notes  # default head_timeout_s 5 s; generous
    assert worst < 2.0, tally.notes
    assert peak - base < 128 * _MiB, tally.notes


async def test_endless_request_heads_are_cut(procs: ProcessGroup, tally: Tally) -> None:
    """8 connections each sending a request head of up to 32 MiB (header lines, as fast as
    the socket takes them): each is refused long before its end and memory stays bounded."""
    d = FakeBackend("D")
    async with d:
        config = {
            "backends": [backend("D", d.url, "consumer", "nixl")],
            "health": {"enabled": False},
            "workers": 2,
        }
        proxy = procs.proxy("proxy", config)
        base = group_rss(proxy)
        line = b"X-Pad: " + b"a" * 8185 + b"\r\n"  # 8 KiB
        limit = 32 * _MiB
        peak = base

        async def endless() -> tuple[int, bytes]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
            sent = 0
            got = b""
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: p\r\n")
                while sent < limit:
                    writer.write(line * 16)
                    sent += len(line) * 16
                    await asyncio.wait_for(writer.drain(), 10)
                    with contextlib.suppress(TimeoutError):
                        got += await asyncio.wait_for(reader.read(4096), 0.0001)
                    if got or reader.at_eof():
                        break
            except (OSError, TimeoutError):
                pass
            finally:
                with contextlib.suppress(OSError, TimeoutError):
                    got += await asyncio.wait_for(reader.read(4096), 2)
                writer.transport.abort()
            return sent, got

        tasks = [asyncio.create_task(endless()) for _ in range(8)]
        while not all(t.done() for t in tasks):
            peak = max(peak, group_rss(proxy))
            await asyncio.sleep(0.05)
        results = [t.result() for t in tasks]
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(f"{proxy.url}/v1/completions", json={"prompt": "after"})
        if r.status_code == 200:
            tally.ok()
        else:
            tally.fail(f"a request after the endless heads: {r.status_code}")
    for sent, got in results:
        if sent < limit and got[:12] in (b"HTTP/1.1 431", b""):
            tally.ok()
        else:
            tally.fail(f"an endless head: {sent / _MiB:.1f} MiB taken, answer {got[:30]!r}")
    tally.notes.append(
        f"8 endless heads: at most {max(s for s, _ in results) / _MiB:.1f} MiB sent each "
        f"before the proxy cut them; RSS {base / _MiB:.0f} -> {peak / _MiB:.0f} MiB (peak)"
    )
    print(tally.notes[-1])
    assert tally.failed == 0, tally.notes
    assert peak - base < 64 * _MiB, tally.notes


async def test_waiting_connections_have_a_budget_per_source_and_in_all(
    procs: ProcessGroup, tally: Tally
) -> None:
    """One source opening 100 silent sockets keeps at most its share; four sources together
    at most the budget (the oldest are closed first); keyed clients are served throughout."""
    d = FakeBackend("D")
    async with d:
        config = {
            "backends": [backend("D", d.url, "consumer", "nixl")],
            "health": {"enabled": False},
            "api_keys": [{"key": _KEY}],
            "admission": {"max_waiting_connections": 48, "max_waiting_per_source": 16},
            "workers": 1,  # the caps are per process: one process makes the counts exact
        }
        proxy = procs.proxy("proxy", config)
        one = HeldSockets(port_of(proxy), ["127.0.0.2"])
        one.open(100)
        for _ in range(100):
            if one.opened >= 100:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        held_by_one = one.held
        many = HeldSockets(port_of(proxy), [f"127.0.0.{i}" for i in range(3, 7)])
        many.open(120)
        for _ in range(100):
            if many.opened >= 120:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        held_in_all = one.held + many.held
        await _legit(proxy.url, 10, tally, gap_s=0.05)
        await one.stop()
        await many.stop()
    tally.notes.append(
        f"one source, 100 silent sockets: {held_by_one} held (cap 16); five sources, 220: "
        f"{held_in_all} held (budget 48); legit {tally.succeeded}/{tally.sent}"
    )
    print(tally.notes[-1])
    assert held_by_one <= 16, tally.notes
    assert held_in_all <= 48, tally.notes
    assert tally.failed == 0, tally.notes
