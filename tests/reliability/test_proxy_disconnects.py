"""Scenario 4: the client leaves before, during and after the producer leg, and mid-stream.

Real proxy, real workers (sim model with a latency model, prefill chunked so that an abort
lands between steps). After each disconnect, both workers must be idle again — nothing running
or waiting, no supply held, no device or host page referenced — within the promised second
(measured from the disconnect by polling the workers' /metrics; ``_PROMISE_S`` adds the poll
and scheduling slack of a busy CI machine and is stated in the report).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from .procs import ProcessGroup, WorkerProcess
from .proxy_client import backend, gauges, wait_for
from .record import Tally
from .resources import ZERO_GAUGES

pytestmark = pytest.mark.slow

_PROMISE_S = 1.0
_SLACK_S = 0.5
_PROMPT = "A client that leaves must cost nothing afterwards. " * 12  # ~600 tokens


def _idle(g: dict[str, float]) -> bool:
    referenced = sum(v for k, v in g.items() if k.startswith("kvtier_worker_kv_referenced_pages"))
    return not referenced and not any(g.get(name, 0.0) for name in ZERO_GAUGES)


async def _both_idle(
    client: httpx.AsyncClient, workers: list[WorkerProcess], timeout_s: float
) -> float | None:
    started = time.monotonic()
    for w in workers:
        remaining = timeout_s - (time.monotonic() - started)
        if await wait_for(client, w, _idle, max(remaining, 0.0)) is None:
            return None
    return time.monotonic() - started


async def _leave_when(
    client: httpx.AsyncClient,
    url: str,
    stream: bool,
    trigger: Callable[[], Awaitable[None]],
) -> None:
    """Send one request; cancel it (closing the connection) once ``trigger`` returns."""
    body = {"prompt": _PROMPT, "max_tokens": 300, "temperature": 0, "stream": stream}

    async def request() -> None:
        if stream:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for _ in resp.aiter_bytes():
                    pass
        else:
            await client.post(f"{url}/v1/completions", json=body)

    task = asyncio.create_task(request())
    try:
        await asyncio.wait_for(trigger(), 20)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task


async def test_proxy_client_disconnects_abort_both_legs(procs: ProcessGroup, tally: Tally) -> None:
    latency = ["--sim-prefill-ms-per-token", "3", "--sim-decode-ms-per-step", "30"]
    chunked = ["--max-batched-tokens", "64"]
    producer = procs.worker("p", role="producer", args=latency + chunked, wait=False)
    consumer = procs.worker("d", role="consumer", args=latency + chunked, wait=False)
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
    workers = [producer, consumer]
    async with httpx.AsyncClient(timeout=30) as client:

        def counter(w: WorkerProcess, name: str) -> Callable[[], Awaitable[float]]:
            async def read() -> float:
                return (await gauges(client, w)).get(f"kvtier_worker_{name}", 0.0)

            return read

        async def until(read: Callable[[], Awaitable[float]], above: float) -> None:
            while await read() <= above:
                await asyncio.sleep(0.01)

        p_running = counter(producer, "running_requests")
        p_done = counter(producer, "finished_requests_total")
        d_running = counter(consumer, "running_requests")
        d_tokens = counter(consumer, "generated_tokens_total")

        async def immediately() -> None:
            return None

        async def during_producer() -> None:
            await until(p_running, 0.0)
            await asyncio.sleep(0.1)

        async def after_producer() -> None:
            await until(p_done, await p_done())

        async def mid_stream() -> None:
            await until(d_running, 0.0)
            await until(d_tokens, await d_tokens() + 3)

        cases: list[tuple[str, bool, Callable[[], Awaitable[None]]]] = [
            ("before the producer leg", False, immediately),
            ("during the producer leg", False, during_producer),
            ("after the producer leg", True, after_producer),
            ("mid-stream", True, mid_stream),
            ("mid-stream, non-streaming client", False, mid_stream),
        ]
        timings: list[str] = []
        for name, stream, trigger in cases:
            p_aborts = (await gauges(client, producer)).get("kvtier_worker_aborted_requests_total")
            await _leave_when(client, proxy.url, stream, trigger)
            left = time.monotonic()
            took = await _both_idle(client, workers, _PROMISE_S + _SLACK_S)
            if took is None:
                g = {w.name: await gauges(client, w) for w in workers}
                busy = {
                    n: {k: v for k, v in m.items() if k in ZERO_GAUGES and v} for n, m in g.items()
                }
                tally.fail(f"{name}: still busy after {time.monotonic() - left:.2f} s: {busy}")
            else:
                tally.ok()
                timings.append(f"{name} {took:.2f} s")
            if name == "during the producer leg":
                now = (await gauges(client, producer)).get("kvtier_worker_aborted_requests_total")
                assert now == (p_aborts or 0) + 1, "the producer leg was not aborted"
        tally.notes.append("idle after: " + ", ".join(timings))
        pg = await gauges(client, proxy)
        tally.notes.append(
            "proxy disconnect aborts: "
            + str({k: v for k, v in pg.items() if k.startswith("pdproxy_disconnect_aborts_total")})
        )
    assert tally.failed == 0, tally.notes
