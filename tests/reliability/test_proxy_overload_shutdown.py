"""Scenario 7 (overload at several times capacity) and 8 (SIGTERM under load), real processes.

7: a burst of 8 times the proxy's admission capacity. Every answer is a 200 or a fast 429 with
   ``Retry-After``; the queue never exceeds its bound; admitted requests all complete (no
   timeout pile-up), and the proxy is idle again afterwards.
8: SIGTERM while streams are in flight: each in-flight stream completes (``[DONE]``, every
   token), new requests are refused cleanly (connection refused or a 503 error body), and the
   proxy exits with status 0.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .openai_shape import check_stream
from .procs import ProcessGroup, WorkerProcess
from .proxy_client import ask, backend, gauges, wait_for
from .record import Tally
from .resources import ZERO_GAUGES

pytestmark = pytest.mark.slow

_LATENCY = ["--sim-prefill-ms-per-token", "0.05", "--sim-decode-ms-per-step", "25"]


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ProcessGroup, list[WorkerProcess]]]:
    group = ProcessGroup(tmp_path_factory.mktemp("pair"))
    try:
        p = group.worker("p", role="producer", args=_LATENCY, wait=False)
        d = group.worker("d", role="consumer", args=_LATENCY, wait=False)
        p.wait_healthy()
        d.wait_healthy()
        yield group, [p, d]
    finally:
        group.close()


def _config(workers: list[WorkerProcess], **extra: object) -> dict[str, object]:
    p, d = workers
    return {
        "backends": [backend("p", p.url, "producer"), backend("d", d.url, "consumer")],
        "health": {"enabled": False},
        **extra,
    }


async def _idle(client: httpx.AsyncClient, workers: list[WorkerProcess]) -> bool:
    for w in workers:
        ok = await wait_for(
            client, w, lambda g: not any(g.get(n, 0.0) for n in ZERO_GAUGES), timeout_s=10
        )
        if ok is None:
            return False
    return True


async def test_proxy_overload_fast_429(
    pair: tuple[ProcessGroup, list[WorkerProcess]], tmp_path: Path, tally: Tally
) -> None:
    _, workers = pair
    procs = ProcessGroup(tmp_path)
    capacity, queue, queue_timeout = 4, 4, 2.0
    try:
        proxy = procs.proxy(
            "proxy",
            _config(
                workers,
                admission={
                    "max_concurrent": capacity,
                    "queue_size": queue,
                    "queue_timeout_s": queue_timeout,
                },
            ),
        )
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            body = {"prompt": "Overload me. " * 20, "max_tokens": 16, "temperature": 0}
            baseline = [await ask(client, proxy.url, body) for _ in range(3)]
            alone_s = sorted(a.elapsed_s for a in baseline)[1]
            depths: list[float] = []
            stop = asyncio.Event()

            async def watch_queue() -> None:
                while not stop.is_set():
                    depths.append((await gauges(client, proxy)).get("pdproxy_queue_depth", 0.0))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch_queue())
            burst = 8 * (capacity + queue)
            try:
                answers = await asyncio.gather(
                    *(ask(client, proxy.url, body) for _ in range(burst))
                )
            finally:
                stop.set()
                await watcher
            admitted = [a for a in answers if a.status == 200]
            refused = [a for a in answers if a.status == 429]
            for a in answers:
                fast_refusal = a.status == 429 and (a.retry_after or "").isdigit()
                if a.status == 200 or fast_refusal:
                    tally.ok()
                else:
                    tally.fail(f"status {a.status}, retry-after {a.retry_after!r}")
            assert len(admitted) + len(refused) == burst
            assert refused, "8x capacity and nothing was refused"
            assert len(admitted) >= capacity
            slowest_refusal = max(a.elapsed_s for a in refused)
            slowest_admitted = max(a.elapsed_s for a in admitted)
            assert slowest_refusal <= queue_timeout + 1.0, "a 429 was not fast"
            # Admitted requests wait at most the queue timeout, then run about as long as alone.
            assert slowest_admitted <= queue_timeout + 4 * alone_s + 1.0
            assert max(depths, default=0.0) <= queue
            tally.notes.append(
                f"burst {burst}: {len(admitted)} admitted (slowest {slowest_admitted:.2f} s, "
                f"alone {alone_s:.2f} s), {len(refused)} x 429 (slowest {slowest_refusal:.2f} s), "
                f"max queue {max(depths, default=0):.0f}/{queue}"
            )
            g = await gauges(client, proxy)
            assert g.get("pdproxy_queue_depth", 0.0) == 0.0
            in_flight = sum(v for k, v in g.items() if k.startswith("pdproxy_backend_in_flight"))
            assert in_flight == 0, g
            assert await _idle(client, workers)
    finally:
        procs.close()
    assert tally.failed == 0, tally.notes


async def test_proxy_sigterm_drains_in_flight(
    pair: tuple[ProcessGroup, list[WorkerProcess]], tmp_path: Path, tally: Tally
) -> None:
    _, workers = pair
    procs = ProcessGroup(tmp_path)
    try:
        proxy = procs.proxy("proxy", _config(workers, drain_timeout_s=20))
        async with httpx.AsyncClient(timeout=30) as client:
            first_bytes = asyncio.Semaphore(0)
            n_streams, max_tokens = 6, 40

            async def stream(i: int) -> bytes:
                body = {
                    "prompt": f"Stream {i} survives the shutdown. " * 8,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                raw = bytearray()
                async with client.stream("POST", f"{proxy.url}/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    signalled = False
                    async for chunk in r.aiter_bytes():
                        raw += chunk
                        if not signalled:
                            signalled = True
                            first_bytes.release()
                return bytes(raw)

            tasks = [asyncio.create_task(stream(i)) for i in range(n_streams)]
            for _ in range(n_streams):
                await asyncio.wait_for(first_bytes.acquire(), 30)
            proxy.signal(signal.SIGTERM)
            sigterm_at = time.monotonic()
            await asyncio.sleep(0.2)
            refusals = 0
            for _ in range(3):
                try:
                    r = await client.post(
                        f"{proxy.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}
                    )
                except httpx.TransportError:
                    refusals += 1  # listener closed: refused cleanly
                    tally.ok()
                    continue
                if r.status_code == 503 and "error" in r.json():
                    refusals += 1
                    tally.ok()
                else:
                    tally.fail(f"new request during drain got {r.status_code}")
            for raw in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(raw, BaseException):
                    tally.fail(f"in-flight stream broke: {type(raw).__name__}: {raw}")
                    continue
                try:
                    events = check_stream(raw)
                except AssertionError as exc:
                    tally.fail(str(exc)[:200])
                    continue
                if b'"completion_tokens":40' in raw and events >= max_tokens:
                    tally.ok()
                else:
                    tally.fail(f"stream incomplete: {events} events")
            status = await asyncio.to_thread(proxy.proc.wait, 30) if proxy.proc else None
            tally.notes.append(
                f"proxy exited {status} {time.monotonic() - sigterm_at:.2f} s after SIGTERM; "
                f"{refusals} late requests refused"
            )
            assert status == 0
            assert await _idle(client, workers)
    finally:
        procs.close()
    assert tally.failed == 0, tally.notes
