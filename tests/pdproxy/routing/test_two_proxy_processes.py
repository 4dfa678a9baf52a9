"""Two real proxy processes (``pdproxy serve``, ``router: kv``) sharing one real Redis.

The fake engines run in the test's event loop; each proxy is a subprocess with its own config
file, stopped by PID when the test ends. The decisions are read from the opt-in
``x-pdproxy-route`` header and checked against what the fake engines received.

Every assertion below is chosen so that it would fail if the proxies did not share state: on an
empty (or private) index both proxies break ties by name, so the "shared" choice is always made
to differ from that name-order default.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from kvtier.events import EventPublisher
from kvtier.residency.types import NodeId
from loadtest.fake_backend import FakeBackend
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.settings.routing import KvRouterSettings
from tests.pdproxy.conftest import FakeFactory, backend_entry
from tests.reliability.procs import ManagedProcess, ProcessGroup, ProcessStartError

from .kv_helpers import BS, SEED, prompt_text, stored

pytestmark = [pytest.mark.slow, pytest.mark.redis]

DEBUG = {"x-pdproxy-debug": "1"}
_ALONE = ("short-suffix", "consumer-holds-prefix", "same-node")
"""Reasons under which the first consumer serves the request without a producer."""


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Proxy processes of this test; every one stopped by PID when it ends."""
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.close()


async def wait_healthy(proc: ManagedProcess, timeout_s: float = 60.0) -> None:
    """Like :meth:`ManagedProcess.wait_healthy` but without blocking the event loop, which
    serves the fake engines."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if not proc.alive:
                raise ProcessStartError(f"{proc.name} exited:\n{proc.log_tail()}")
            try:
                if (await client.get(proc.url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise ProcessStartError(f"{proc.name} not healthy in {timeout_s} s:\n{proc.log_tail()}")


def proxy_config(backends: list[dict[str, Any]], index_url: str) -> dict[str, Any]:
    return {
        "backends": backends,
        "router": "kv",
        "router_options": {
            "model_seed": SEED,
            "block_size": BS,
            "index_url": index_url,
            # Generous bounds: this test is about sharing, not about Redis deadlines, and the
            # machine may be busy (a call past the deadline would route by local load alone).
            "redis_deadline_s": 1.0,
            "prediction_ttl_s": 60.0,
        },
        "debug_headers": True,
        "health": {"enabled": False},
        "retries": {"backoff_base_s": 0.001, "backoff_max_s": 0.005},
    }


def route_of(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    explain: dict[str, Any] = json.loads(resp.headers["x-pdproxy-route"])
    assert explain["index"] == "redis", explain  # the shared index answered, no fallback
    return explain


def choice(explain: dict[str, Any]) -> tuple[str, str | None, str]:
    """(consumer, producer or None when the consumer prefills alone, reason)."""
    producer = explain["producers"][0]["name"] if explain["reason"] not in _ALONE else None
    return explain["consumers"][0]["name"], producer, explain["reason"]


def completion(prompt: str) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 2}


def rows(explain: dict[str, Any], side: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in explain[side]}


async def wait_received(backends: list[FakeBackend], count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(len(b.consumer_legs()) for b in backends) < count:
        assert time.monotonic() < deadline, "held requests never reached a consumer"
        await asyncio.sleep(0.02)


async def in_flight_in_redis(redis_url: str, node: str) -> int:
    """Requests in flight on ``node`` as the replicas' shared load counts them (the layout in
    :mod:`pdproxy.routing.kv.shared_load`)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        total = 0
        async for key in client.scan_iter(match="*:load"):
            fields = await client.hgetall(key)
            total += sum(int(v) for f, v in fields.items() if f.endswith(f"|if|{node}".encode()))
        return total
    finally:
        await client.aclose()


async def wait_in_flight(redis_url: str, node: str, count: int, timeout_s: float = 5.0) -> None:
    """Until the shared load counts ``count`` requests on ``node``: a proxy gives a request's
    load back once its answer was sent, so its client may hold the answer a moment earlier."""
    deadline = time.monotonic() + timeout_s
    while (seen := await in_flight_in_redis(redis_url, node)) != count:
        assert time.monotonic() < deadline, f"{node}: {seen} requests in flight, not {count}"
        await asyncio.sleep(0.02)


async def test_two_proxy_processes_share_choice_and_in_flight_load(
    fake: FakeFactory, procs: ProcessGroup, redis_url: str
) -> None:
    p0, p1 = await fake("p0"), await fake("p1")
    c0, c1 = await fake("c0", hang=True), await fake("c1", hang=True)
    consumers = [c0, c1]
    backends = [
        backend_entry(p0, "producer", "p2p"),
        backend_entry(p1, "producer", "p2p"),
        backend_entry(c0, "consumer", "p2p"),
        backend_entry(c1, "consumer", "p2p"),
    ]
    a = procs.proxy("proxy-a", proxy_config(backends, redis_url), wait=False)
    b = procs.proxy("proxy-b", proxy_config(backends, redis_url), wait=False)
    await asyncio.gather(wait_healthy(a), wait_healthy(b))

    async with (
        httpx.AsyncClient(base_url=a.url, timeout=20.0, headers=DEBUG) as via_a,
        httpx.AsyncClient(base_url=b.url, timeout=20.0, headers=DEBUG) as via_b,
    ):
        # (b) In-flight load: proxy A holds one request on a consumer (every consumer hangs
        # for now); short prompts are served by the consumer alone.
        held = asyncio.ensure_future(via_a.post("/v1/completions", json=completion("hold 0")))
        try:
            await wait_received(consumers, 1)
            busy = next(c for c in consumers if c.consumer_legs())
            idle = next(c for c in consumers if c is not busy)
            for c in consumers:  # new requests are answered; the held one stays held
                c.behavior.hang = False
            probe = route_of(await via_b.post("/v1/completions", json=completion("probe 1")))
            seen = rows(probe, "consumers")
            assert seen[busy.name]["in_flight"] == 1, probe  # A's request, counted by B
            assert seen[idle.name]["in_flight"] == 0, probe
            assert choice(probe)[0] == idle.name, probe  # B routes away from A's load
            assert len(idle.consumer_legs()) == 1 and len(busy.consumer_legs()) == 1

            # (a) Same state, same choice. While A's request still loads ``busy``, A routes a
            # long prompt: it goes to ``idle`` with a producer, and A predicts the prompt's
            # blocks on both. (The name-order default would be c0, which ``busy`` usually is;
            # either way, the sibling below must follow A's choice, not B's own default.)
            prefix = prompt_text(1)
            await wait_in_flight(redis_url, busy.name, 1)  # A's held request
            await wait_in_flight(redis_url, idle.name, 0)  # B's probe, given back
            first = route_of(await via_a.post("/v1/completions", json=completion(prefix + "q1")))
            first_consumer, first_producer, _ = choice(first)
            assert first_consumer == idle.name and first_producer is not None, first
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
        # A's held request is gone: B sees the release (no load left anywhere).
        deadline = time.monotonic() + 5
        while True:
            after = route_of(await via_b.post("/v1/completions", json=completion("probe 2")))
            if all(r["in_flight"] == 0 for r in after["consumers"] + after["producers"]):
                break
            assert time.monotonic() < deadline, after
            await asyncio.sleep(0.05)

        # A sibling sharing the prefix, through B: B sees A's predictions on ``idle`` (the whole
        # prefix), so ``idle`` prefills alone. A private index would have no prediction and
        # would pick c0 (name order) with a producer.
        sibling = completion(prefix + "q2")
        from_b = route_of(await via_b.post("/v1/completions", json=sibling))
        assert choice(from_b)[0] == first_consumer, from_b
        predicted = rows(from_b, "consumers")[first_consumer]["predicted"]
        assert predicted == len(prefix) // BS, from_b
        # Routing the sibling changed no residency (the node already held every block) and its
        # load is released: the same request through A meets the same state.
        from_a = route_of(await via_a.post("/v1/completions", json=sibling))
        assert choice(from_a) == choice(from_b), (from_a, from_b)
        assert [r["name"] for r in from_a["consumers"]] == [r["name"] for r in from_b["consumers"]]

    # What the engines received agrees with the headers.
    siblings = [r for r in idle.consumer_legs() if r.json()["prompt"] == prefix + "q2"]
    assert len(siblings) == 2
    others = [c for c in (c0, c1) if c is not idle] + [p0, p1]
    assert not any(r.json()["prompt"] == prefix + "q2" for o in others for r in o.completions())
    first_legs = {
        p.name: [r for r in p.producer_legs() if r.json()["prompt"] == prefix + "q1"]
        for p in (p0, p1)
    }
    assert {n: len(legs) for n, legs in first_legs.items() if legs} == {first_producer: 1}


async def test_residency_heard_by_one_proxy_routes_the_other(
    fake: FakeFactory, procs: ProcessGroup, redis_url: str
) -> None:
    """Only proxy A subscribes to p1's KV events; B routes by them all the same."""
    p0, p1, c0 = await fake("p0"), await fake("p1"), await fake("c0")
    prefix = prompt_text(2)
    observer = build_kv_router(
        KvRouterSettings(model_seed=SEED, block_size=BS, index_url=redis_url),
        metrics_registry=CollectorRegistry(),
    )
    try:
        async with EventPublisher("tcp://127.0.0.1:*") as pub:
            plain = [backend_entry(p0, "producer", "p2p"), backend_entry(c0, "consumer", "p2p")]
            heard = backend_entry(p1, "producer", "p2p", events_endpoint=pub.endpoint)
            silent = backend_entry(p1, "producer", "p2p")
            a = procs.proxy("proxy-a", proxy_config([*plain, heard], redis_url), wait=False)
            b = procs.proxy("proxy-b", proxy_config([*plain, silent], redis_url), wait=False)
            await asyncio.gather(wait_healthy(a), wait_healthy(b))
            hashes = observer.hasher.hash_tokens(list(prefix.encode()))
            deadline = time.monotonic() + 10
            while NodeId("p1") not in await observer.state.index.match(hashes):
                assert time.monotonic() < deadline, f"events never reached Redis:\n{a.log_tail()}"
                await pub.publish(stored(prefix))  # PUB/SUB joins late: republish until applied
                await asyncio.sleep(0.05)
        async with httpx.AsyncClient(base_url=b.url, timeout=20.0, headers=DEBUG) as via_b:
            explain = route_of(await via_b.post("/v1/completions", json=completion(prefix + "q")))
    finally:
        await observer.close()
    # Name order alone (a private index) would pick p0.
    assert choice(explain) == ("c0", "p1", "kv-prefix"), explain
    assert rows(explain, "producers")["p1"]["gpu"] == len(prefix) // BS, explain
    assert len(p1.producer_legs()) == 1 and p0.producer_legs() == []
