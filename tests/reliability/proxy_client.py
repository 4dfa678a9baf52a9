"""Client-side helpers for the proxy scenarios: one request, classified for the tally."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from .openai_shape import MalformedAnswer, check_answer
from .procs import ManagedProcess, WorkerProcess
from .resources import parse_metrics


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    text: str
    fallback: bool
    retries: int
    elapsed_s: float
    retry_after: str | None
    kind: str


async def ask(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Answer:
    """POST a completion (streamed or not) through ``url`` and check the answer's shape."""
    started = time.monotonic()
    resp = await client.post(f"{url}/v1/completions", json=body)
    elapsed = time.monotonic() - started
    kind = check_answer(
        resp.status_code, resp.content, resp.headers.get("content-type", ""), chat=False
    )
    text = ""
    if kind == "ok":
        text = resp.json()["choices"][0]["text"]
    elif kind == "stream":
        text = stream_text(resp.content)
    return Answer(
        status=resp.status_code,
        text=text,
        fallback="x-pdproxy-fallback" in resp.headers,
        retries=int(resp.headers.get("x-pdproxy-retries", "0") or 0),
        elapsed_s=elapsed,
        retry_after=resp.headers.get("retry-after"),
        kind=kind,
    )


def stream_text(raw: bytes) -> str:
    import orjson

    parts: list[str] = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            event = orjson.loads(line[6:])
            if "error" in event:
                raise MalformedAnswer(f"error event in a stream that should succeed: {event}")
            parts.extend(c.get("text", "") for c in event.get("choices", []))
    return "".join(parts)


async def gauges(client: httpx.AsyncClient, proc: ManagedProcess) -> dict[str, float]:
    return parse_metrics((await client.get(f"{proc.url}/metrics")).text)


async def wait_for(
    client: httpx.AsyncClient,
    proc: WorkerProcess | ManagedProcess,
    predicate: Any,
    timeout_s: float,
    interval_s: float = 0.02,
) -> float | None:
    """Seconds until ``predicate(metrics)`` held, or None if it did not within ``timeout_s``."""
    started = time.monotonic()
    while True:
        if predicate(await gauges(client, proc)):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            return None
        await asyncio.sleep(interval_s)


def backend(name: str, url: str, role: str, dialect: str = "p2p") -> dict[str, str]:
    return {"name": name, "url": url, "role": role, "dialect": dialect}
