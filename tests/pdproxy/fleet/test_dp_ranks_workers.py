"""Data-parallel ranks end to end: the proxy (KV router) in front of two reference workers with
two ranks each (``sim``), a producer and a consumer, over real HTTP, ZMQ events and P2P.

A prompt lands on the (backend, rank) that holds it, the legs carry ``X-data-parallel-rank``
(the rank named in the route explanation is the engine that served), the producer's rank ``r``
answers from its P2P port base + ``r`` (the proxy checks it against ``kv_address`` + ``r``),
the consumer's rank fetches from it and answers exactly what one plain worker answers, and
events of one rank never make another rank resident."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvtier.residency.types import NodeId
from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings
from loadtest.dp_workers import RunningWorker, dp_worker
from pdproxy.fleet.dp_ranks import rank_node
from pdproxy.routing.dp_router import DpRankRouter
from pdproxy.routing.kv.router import KvRouter
from tests.pdproxy.conftest import ProxyFactory, RunningProxy, quick_settings
from tests.pdproxy.routing.kv_helpers import prompt_text

pytestmark = pytest.mark.slow

PROMPT_BYTES = 1024


def body(prompt: str) -> dict[str, Any]:
    return {"model": "kvtier-sim", "prompt": prompt, "max_tokens": 8, "temperature": 0}


@contextlib.asynccontextmanager
async def pd_ranks(proxy: ProxyFactory) -> AsyncIterator[tuple[RunningProxy, RunningWorker,
                                                               RunningWorker]]:  # fmt: skip
    async with dp_worker("p", "producer", 2) as p, dp_worker("c", "consumer", 2) as c:
        settings = quick_settings(
            [p.backend("producer"), c.backend("consumer")],
            router="kv",
            router_options={
                "model_seed": p.settings.hash_seed,
                "block_size": p.settings.block_size,
                "prediction_ttl_s": 0.05,
            },
            debug_headers=True,
        )
        running = await proxy(settings)
        yield running, p, c


def router_of(running: RunningProxy) -> KvRouter:
    router = running.state.router
    assert isinstance(router, DpRankRouter) and isinstance(router.inner, KvRouter)
    return router.inner


async def holds(router: KvRouter, node: str, prompt: str) -> int:
    hashes = router.hasher.hash_tokens(list(prompt.encode()))
    m = (await router.state.index.match(hashes)).get(NodeId(node))
    return 0 if m is None else m.total


async def eventually_holds(router: KvRouter, node: str, prompt: str, blocks: int) -> None:
    for _ in range(200):
        if await holds(router, node, prompt) >= blocks:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"{node} never became resident")


async def post(
    client: httpx.AsyncClient, prompt: str, rank: str | None = None
) -> tuple[str, dict[str, Any]]:
    headers = {"x-pdproxy-debug": "1"}
    if rank is not None:  # a client naming a rank itself: the proxy alone picks ranks
        headers["x-data-parallel-rank"] = rank
    resp = await client.post("/v1/completions", json=body(prompt), headers=headers)
    assert resp.status_code == 200, resp.text
    assert "x-pdproxy-fallback" not in resp.headers  # the producer leg was used as planned
    return resp.json()["choices"][0]["text"], json.loads(resp.headers["x-pdproxy-route"])


async def single_node_text(prompt: str) -> str:
    app = create_app(WorkerSettings(model="sim", num_pages=200, max_model_len=4096))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
            resp = await client.post("/v1/completions", json=body(prompt))
            assert resp.status_code == 200, resp.text
            return str(resp.json()["choices"][0]["text"])


def prompt_tokens(worker: RunningWorker) -> list[int]:
    return [w.stats.prompt_tokens for w in worker.ranks.workers]


async def test_requests_follow_their_rank_and_transfer_between_ranks(
    proxy: ProxyFactory,
) -> None:
    async with pd_ranks(proxy) as (running, p, c):
        router = router_of(running)
        a, b = prompt_text(1, PROMPT_BYTES), prompt_text(2, PROMPT_BYTES)
        async with running.client() as client:
            # Two at once: the load charged on the first pair sends the second to the other ranks.
            (text_a, route_a), (text_b, route_b) = await asyncio.gather(
                post(client, a, rank="7"), post(client, b)
            )
            ranks = {route_a["consumer_rank"], route_b["consumer_rank"]}
            assert ranks == {0, 1}
            assert {route_a["producer_rank"], route_b["producer_rank"]} == {0, 1}
            # The header reached the engines the explanation names: each rank served one leg.
            assert all(n > 0 for n in prompt_tokens(p)) and all(n > 0 for n in prompt_tokens(c))
            # Every consumer rank fetched its prompt's KV from its producer rank over P2P.
            assert all(w.stats.p2p_blocks_fetched > 0 for w in c.ranks.workers)
            assert text_a == await single_node_text(a)
            assert text_b == await single_node_text(b)

            a_node = rank_node("c", route_a["consumer_rank"])
            b_node = rank_node("c", route_b["consumer_rank"])
            await eventually_holds(router, a_node, a, PROMPT_BYTES // 16)
            await eventually_holds(router, b_node, b, PROMPT_BYTES // 16)
            await asyncio.sleep(0.1)  # the first decisions' predictions have expired
            # Each rank's events made only that rank resident.
            assert await holds(router, b_node, a) == 0
            assert await holds(router, a_node, b) == 0

            before = [w.stats.prefix_hit_tokens for w in c.ranks.workers]
            for prompt, route in ((a, route_a), (b, route_b)):
                again, explained = await post(client, prompt)
                assert explained["consumer_rank"] == route["consumer_rank"]
                assert explained["reason"] in ("consumer-holds-prefix", "short-suffix")
                assert again == (text_a if prompt == a else text_b)
            after = [w.stats.prefix_hit_tokens for w in c.ranks.workers]
            assert all(y - x >= PROMPT_BYTES - 16 for x, y in zip(before, after, strict=True))


async def test_worker_refuses_a_rank_out_of_range_and_balances_without_one() -> None:
    """As vLLM 0.32: an integer out of range is a 400, a header that is no integer is
    ignored (the load decides)."""
    app = create_app(
        WorkerSettings(model="sim", num_pages=64, max_model_len=2048, data_parallel_size=2)
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
            for bad in ("2", "-1", " 7"):
                resp = await client.post(
                    "/v1/completions",
                    json=body("hello"),
                    headers={"x-data-parallel-rank": bad},
                )
                assert resp.status_code == 400, bad
                assert resp.json()["error"]["param"] == "x-data-parallel-rank"
            for ignored in (None, "x", None, "1.0"):  # idle ranks: round robin
                headers = {} if ignored is None else {"x-data-parallel-rank": ignored}
                resp = await client.post("/v1/completions", json=body("hello"), headers=headers)
                assert resp.status_code == 200
            workers = app.state.ranks.workers
            assert [w.stats.finished_requests for w in workers] == [2, 2]
            metrics = (await client.get("/metrics")).text
            assert 'kvtier_worker_finished_requests_total{data_parallel_rank="1"} 2.0' in metrics
