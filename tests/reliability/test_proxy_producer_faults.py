"""Scenario 2: producers that answer 5xx, refuse connections or hang.

The proxy (a real ``pdproxy serve`` process) fronts one real producer, three broken ones and
one real consumer. Every client request must succeed with the same text the consumer produces
alone — retried on another producer, or served by the consumer alone — while the broken
producers' breakers open; once a producer heals, its breaker closes again. When every producer
is broken, requests still succeed (consumer-only fallback).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from loadtest.fake_backend import Behavior, FakeBackend
from tests.conftest import free_port

from .legs import completion
from .procs import ProcessGroup
from .proxy_client import Answer, ask, backend, gauges
from .record import Tally

pytestmark = pytest.mark.slow

_PROMPTS = [f"Prompt {i}: retries must never change the answer. " * 5 for i in range(4)]


def _breaker(g: dict[str, float], name: str) -> float:
    return g.get(f'pdproxy_backend_breaker_state{{backend="{name}"}}', -1.0)


async def _burst(
    client: httpx.AsyncClient, url: str, n: int, tally: Tally, answers: dict[str, set[str]]
) -> list[Answer]:
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> Answer | None:
        prompt = _PROMPTS[i % len(_PROMPTS)]
        async with sem:
            try:
                a = await ask(client, url, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
            except (AssertionError, httpx.HTTPError) as exc:
                tally.fail(f"{type(exc).__name__}: {str(exc)[:160]}")
                return None
        if a.status != 200:
            tally.fail(f"status {a.status}")
            return a
        tally.ok(fallback=a.fallback or a.retries > 0)
        answers.setdefault(prompt, set()).add(a.text)
        return a

    got = await asyncio.gather(*(one(i) for i in range(n)))
    return [a for a in got if a is not None]


async def test_proxy_producer_5xx_refused_hung(procs: ProcessGroup, tally: Tally) -> None:
    producer = procs.worker("good-producer", role="producer", wait=False)
    consumer = procs.worker("consumer", role="consumer", wait=False)
    failing = FakeBackend("p-5xx", Behavior(fail_status=503, fail_producer_only=True))
    hung = FakeBackend("p-hang", Behavior(hang=True))
    refused_url = f"http://127.0.0.1:{free_port()}"
    producer.wait_healthy()
    consumer.wait_healthy()
    async with failing, hung, httpx.AsyncClient(timeout=60) as client:
        config = {
            "router": "round_robin",
            "backends": [
                backend("p-5xx", failing.url, "producer"),
                backend("p-hang", hung.url, "producer"),
                backend("p-refused", refused_url, "producer"),
                backend("p-good", producer.url, "producer"),
                backend("d", consumer.url, "consumer"),
            ],
            "health": {"enabled": False},
            "timeouts": {"connect_s": 0.5, "producer_total_s": 1.0},
            "retries": {"producer_attempts": 2, "backoff_base_s": 0.01, "budget_s": 5},
            "breaker": {"failure_threshold": 2, "open_s": 1.5},
        }
        proxy = procs.proxy("proxy", config)
        answers: dict[str, set[str]] = {}

        # Phase 1: three of four producers broken.
        got = await _burst(client, proxy.url, 24, tally, answers)
        g = await gauges(client, proxy)
        for name in ("p-5xx", "p-hang", "p-refused"):
            assert _breaker(g, name) in (1.0, 2.0), f"{name}'s breaker never opened: {g}"
        assert _breaker(g, "p-good") == 0.0
        assert any(a.retries > 0 for a in got), "no request was retried"

        # Phase 2: every producer broken → consumer-only fallback, still no failure.
        producer.signal(19)  # SIGSTOP: the good producer hangs too
        try:
            got = await _burst(client, proxy.url, 8, tally, answers)
        finally:
            producer.signal(18)
        assert any(a.fallback for a in got), "no consumer-only fallback while all producers hung"

        # Phase 3: the 5xx producer heals; after open_s its breaker half-opens, then closes.
        failing.behavior.fail_status = None
        failing.behavior.fail_count = 0
        await asyncio.sleep(1.6)
        await _burst(client, proxy.url, 12, tally, answers)
        g = await gauges(client, proxy)
        assert _breaker(g, "p-5xx") == 0.0, f"healed producer's breaker did not close: {g}"

        # Never a wrong answer: every text equals what the consumer computes alone.
        for prompt, texts in answers.items():
            alone = await completion(
                client, consumer.url, {"prompt": prompt, "max_tokens": 6, "temperature": 0}
            )
            assert texts == {alone["choices"][0]["text"]}, (prompt, texts)
    tally.notes.append(f"{tally.fallback} of {tally.succeeded} recovered by retry or fallback")
    assert tally.failed == 0, tally.notes
