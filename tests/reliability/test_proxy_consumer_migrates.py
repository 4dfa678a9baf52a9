"""Mid-stream failover with real workers: the consumer serving a stream is SIGKILLed.

Three sim reference workers behind a proxy process with ``failover.max_migrations: 1``. For a
completion and a chat stream in turn, the worker serving the stream is killed after a few
tokens: the client's stream must go on without an error, its text must equal the answer the
worker gives uninterrupted (greedy), its usage must count the original prompt and every token,
and the surviving workers must hold nothing afterwards.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import orjson
import pytest

from .procs import ProcessGroup, WorkerProcess
from .proxy_client import backend, gauges, wait_for
from .resources import ZERO_GAUGES

pytestmark = pytest.mark.slow

TOKENS = 40


async def _serving(client: httpx.AsyncClient, workers: list[WorkerProcess]) -> WorkerProcess:
    for _ in range(200):
        for w in workers:
            if w.alive and (await gauges(client, w)).get("kvtier_worker_running_requests", 0):
                return w
        await asyncio.sleep(0.01)
    raise AssertionError("no worker is running the stream")


async def _stream_and_kill(
    client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], alive: list[WorkerProcess]
) -> tuple[list[dict[str, Any]], int, WorkerProcess]:
    events: list[dict[str, Any]] = []
    done = 0
    killed: WorkerProcess | None = None
    async with client.stream("POST", f"{url}{path}", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done += 1
                continue
            events.append(orjson.loads(data))
            if len(events) == 5 and killed is None:
                killed = await _serving(client, alive)
                killed.signal(signal.SIGKILL)
    assert killed is not None
    return events, done, killed


def _text(events: list[dict[str, Any]]) -> str:
    out = ""
    for e in events:
        for c in e.get("choices") or []:
            out += c["delta"].get("content") or "" if "delta" in c else c.get("text", "")
    return out


async def test_stream_survives_its_consumer_being_killed(procs: ProcessGroup) -> None:
    latency = ["--sim-decode-ms-per-step", "25"]
    workers = [procs.worker(f"d{i}", args=latency, wait=False) for i in range(3)]
    for w in workers:
        w.wait_healthy()
    proxy = procs.proxy(
        "proxy",
        {
            "backends": [backend(w.name, w.url, "consumer") for w in workers],
            "health": {"enabled": False},
            "failover": {"max_migrations": 1},
        },
    )
    cases = [
        ("/v1/completions", {"prompt": "A fox and a block of sixteen tokens. " * 4}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}]}),
    ]
    alive = list(workers)
    async with httpx.AsyncClient(timeout=60) as client:
        for path, extra in cases:
            base = {**extra, "max_tokens": TOKENS, "temperature": 0}
            reference = (await client.post(f"{alive[0].url}{path}", json=base)).json()
            choice = reference["choices"][0]
            expected = choice["message"]["content"] if "message" in choice else choice["text"]
            body = {**base, "stream": True, "stream_options": {"include_usage": True}}
            events, done, killed = await asyncio.wait_for(
                _stream_and_kill(client, proxy.url, path, body, alive), 60
            )
            alive.remove(killed)
            assert [e for e in events if "error" in e] == []
            assert done == 1
            assert _text(events) == expected
            assert len({e["id"] for e in events}) == 1
            usage = events[-1]["usage"]
            assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
            assert usage["completion_tokens"] == TOKENS
        for w in alive:
            idle = await wait_for(
                client, w, lambda g: not any(g.get(n, 0.0) for n in ZERO_GAUGES), 10
            )
            assert idle is not None, f"{w.name} still holds requests or supply"
        metrics = (await client.get(f"{proxy.url}/metrics")).text
        assert 'pdproxy_stream_migrations_total{outcome="migrated"} 2.0' in metrics
