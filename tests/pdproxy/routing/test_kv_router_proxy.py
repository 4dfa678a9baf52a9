"""The KV-aware router inside the real proxy (``router: kv``), with fake engines as real HTTP
servers and real KV events over ZMQ; and Redis killed under client traffic."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvtier.events import EventPublisher
from pdproxy.routing.kv.router import KvRouter
from tests.conftest import RedisServer
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

from .kv_helpers import BS, SEED, prompt_text, stored


def kv_settings(backends: list[dict[str, Any]], **options: Any) -> Any:
    return quick_settings(
        backends,
        router="kv",
        router_options={"model_seed": SEED, "block_size": BS, **options},
    )


async def test_proxy_routes_to_the_producer_its_events_name(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0, p1 = await fake("p0"), await fake("p1")
    c0 = await fake("c0", cached_tokens=0)
    prefix = prompt_text(1)
    async with EventPublisher("tcp://127.0.0.1:*") as pub:
        backends = [
            backend_entry(p0, "producer", "p2p"),
            backend_entry(p1, "producer", "p2p", events_endpoint=pub.endpoint),
            backend_entry(c0, "consumer", "p2p"),
        ]
        running = await proxy(kv_settings(backends, prediction_ttl_s=0.05))
        router = running.state.router
        assert isinstance(router, KvRouter)
        hashes = router.hasher.hash_tokens(list(prefix.encode()))
        deadline = time.monotonic() + 5
        # The registry's endpoint is followed:
        while "p1" not in await router.state.index.match(hashes):
            assert time.monotonic() < deadline, "events never arrived"
            await pub.publish(stored(prefix))
            await asyncio.sleep(0.05)
        async with running.client() as client:
            for i in range(3):
                body = {"model": "m", "prompt": prefix + f" q{i}", "max_tokens": 2}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                await asyncio.sleep(0.06)  # predictions expire: the events decide
    assert len(p1.producer_legs()) == 3 and p0.producer_legs() == []
    assert len(c0.consumer_legs()) == 3
    # Telemetry: the fake consumer reported 0 cached tokens where the router predicted the
    # whole prompt (P2P supplies it): the drift histogram has it.
    drift = router.metrics.registry.get_sample_value(
        "pdproxy_kv_router_cached_tokens_drift_count", {"mode": "pd"}
    )
    assert drift == 3


@pytest.mark.redis
async def test_redis_killed_under_traffic_fails_no_client_request(
    fake: FakeFactory, proxy: ProxyFactory, own_redis: RedisServer
) -> None:
    p0, c0, c1 = await fake("p0"), await fake("c0"), await fake("c1")
    backends = [
        backend_entry(p0, "producer", "p2p"),
        backend_entry(c0, "consumer", "p2p"),
        backend_entry(c1, "consumer", "p2p"),
    ]
    running = await proxy(kv_settings(backends, index_url=own_redis.url, breaker_cooldown_s=0.2))
    router = running.state.router
    assert isinstance(router, KvRouter)
    statuses: list[int] = []
    sources: list[str] = []
    async with running.client() as client:

        async def one(i: int) -> None:
            body = {"model": "m", "prompt": prompt_text(i % 4) + str(i), "max_tokens": 2}
            resp = await client.post("/v1/completions", json=body)
            statuses.append(resp.status_code)

        for i in range(60):
            if i == 20:
                own_redis.stop()
            if i == 40:
                own_redis.start()
                await asyncio.sleep(0.3)  # past the breaker's cooldown
            await asyncio.gather(one(2 * i), one(2 * i + 1))
            sources.append(router.breaker_state.name)
    assert statuses == [200] * 120
    assert "OPEN" in sources[20:40]
    assert sources[-1] == "CLOSED"
