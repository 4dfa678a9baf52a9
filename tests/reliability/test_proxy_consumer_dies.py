"""Scenario 3: the consumer hangs (SIGSTOP) or dies (SIGKILL) in the middle of a stream.

The client must get a terminated stream that ends with an error event — within the proxy's
consumer idle timeout for a hung consumer, at once for a dead one — never a stream that just
stops or hangs; and the producer must hold no supply afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import orjson
import pytest

from .procs import ProcessGroup, WorkerProcess
from .proxy_client import backend, wait_for
from .record import Tally
from .resources import ZERO_GAUGES

pytestmark = pytest.mark.slow

_IDLE_S = 1.5
_SLACK_S = 1.0


async def _stream_until_fault(
    client: httpx.AsyncClient, url: str, consumer: WorkerProcess, sig: int
) -> tuple[list[dict[str, object]], float]:
    """Stream a long answer; after a few tokens send ``sig`` to the consumer. Returns the data
    events received and the seconds from the signal to the end of the stream."""
    body = {"prompt": "Stream until the consumer fails. " * 8, "max_tokens": 400, "stream": True}
    events: list[dict[str, object]] = []
    faulted_at = 0.0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                events.append({"done": True})
                continue
            events.append(orjson.loads(data))
            if len(events) == 4:
                consumer.signal(sig)
                faulted_at = time.monotonic()
    assert faulted_at, "the stream ended before the fault"
    return events, time.monotonic() - faulted_at


async def test_proxy_consumer_hangs_or_dies_mid_stream(procs: ProcessGroup, tally: Tally) -> None:
    latency = ["--sim-decode-ms-per-step", "30"]
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
            "timeouts": {"consumer_idle_s": _IDLE_S},
        },
    )
    async with httpx.AsyncClient(timeout=30) as client:
        for name, sig, bound in (
            ("hung consumer", signal.SIGSTOP, _IDLE_S + _SLACK_S),
            ("dead consumer", signal.SIGKILL, _SLACK_S),
        ):
            try:
                events, took = await asyncio.wait_for(
                    _stream_until_fault(client, proxy.url, consumer, sig), 30
                )
            finally:
                if sig == signal.SIGSTOP:
                    consumer.signal(signal.SIGCONT)
            errors = [e for e in events if "error" in e]
            if not errors:
                tally.fail(f"{name}: the stream ended without an error event: {events[-2:]}")
            elif took > bound:
                tally.fail(f"{name}: the error came {took:.2f} s after the fault (> {bound} s)")
            else:
                tally.ok()
                tally.notes.append(f"{name}: error event {took:.2f} s after the fault")
        consumer.kill()
        idle = await wait_for(
            client, producer, lambda g: not any(g.get(n, 0.0) for n in ZERO_GAUGES), 10
        )
        if idle is None:
            tally.leaks.append("producer still holds supply or requests")
    assert tally.failed == 0, tally.notes
    assert not tally.leaks, tally.leaks
