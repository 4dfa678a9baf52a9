"""Symmetric pull end to end: reference workers (``sim``, and ``tiny`` torch) behind the real
proxy. The holder of a prompt's prefix is overloaded, another node is idle: the request goes
to the idle node with ``remote_kv_source`` naming the holder, the idle node pulls the blocks
over P2P, and its greedy output equals the holder's own (single-node) output."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from loadtest.pull_cluster import PullCluster, pull_cluster
from pdproxy.routing.kv.scorers.engine_load import EngineLoadScorer
from pdproxy.routing.kv.scorers.pull import PullScorer
from pdproxy.routing.kv.state import LoadDelta
from pdproxy.settings.scorers import PullSettings

pytestmark = pytest.mark.slow

SIM_GROUP_PAGE_BYTES = 2 * 16 * 16
"""One sim page of one KV-cache group: 2 layers x 16 tokens x 16 bytes."""
PULL = {"enabled": True, "block_bytes": 2 * SIM_GROUP_PAGE_BYTES}
PULL_LINK_DEFAULT = PullSettings().link_bytes_per_s


def prompt(length: int, tag: str = "") -> str:
    unit = "[shared] you are a careful assistant; answer briefly. "
    return (unit * (length // len(unit) + 1))[:length] + tag


async def complete(client: httpx.AsyncClient, text: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": text, "max_tokens": 8, "temperature": 0, **extra}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    answer["_route"] = resp.headers.get("x-pdproxy-route", "")
    return answer


async def warm_holder(c: PullCluster, holder: str, text: str) -> str:
    """``holder`` computes ``text`` (sent to it directly); returns its single-node output once
    the router's index has the holder's events."""
    async with httpx.AsyncClient(base_url=c.nodes[holder].url, timeout=120) as direct:
        answer = await complete(direct, text)
    ids = list(text.encode())
    blocks = (len(ids) - 1) // 16
    for _ in range(200):
        if await c.holds(holder, ids, blocks):
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the holder's KV events never reached the router")
    return str(answer["choices"][0]["text"])


def overload(c: PullCluster, holder: str) -> None:
    """The holder has many requests in flight (as other proxy replicas would report them)."""
    c.router.state.local.apply([LoadDelta(holder, 20, 8000)])


async def test_pull_off_the_idle_node_recomputes() -> None:
    async with pull_cluster(pull={"enabled": False}) as c:
        text = prompt(1024, " question one")
        expected = await warm_holder(c, "a", text)
        overload(c, "a")
        async with c.client() as client:
            answer = await complete(client, text)
        assert answer["choices"][0]["text"] == expected  # same KV, recomputed
        b = c.nodes["b"]
        assert b.counter("prefix_hit_tokens") == 0
        assert c.router.metrics.registry.get_sample_value(
            "pdproxy_kv_pulls_total", {"holder": "a"}
        ) in (None, 0.0)


def route_of(answer: dict[str, Any]) -> dict[str, Any]:
    route: dict[str, Any] = json.loads(answer["_route"])
    return route


async def test_idle_node_pulls_the_prefix_and_answers_as_the_holder_would() -> None:
    async with pull_cluster(pull=PULL) as c:
        text = prompt(1024, " question one")
        expected = await warm_holder(c, "a", text)
        overload(c, "a")
        a, b = c.nodes["a"], c.nodes["b"]
        served_by_a = a.counter("finished_requests")
        async with c.client() as client:
            answer = await complete(client, text)
        route = route_of(answer)
        assert route["reason"] == "pull", route
        assert route["pull"]["holder"] == "a" and route["pull"]["target"] == "b"
        assert answer["choices"][0]["text"] == expected  # the right KV arrived
        blocks = (len(text.encode()) - 1) // 16
        assert b.counter("pull_requests") == 1 and b.counter("pull_failures") == 0
        # Pulled pages: every block of the full-attention group, the window's of the other.
        assert blocks <= b.counter("pull_blocks") < 2 * blocks
        assert b.counter("pull_bytes") == b.counter("pull_blocks") * SIM_GROUP_PAGE_BYTES
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
        assert a.counter("finished_requests") == served_by_a  # a computed nothing for it
        server = a.connector.server
        assert server is not None and server.offers is not None
        held = server.offers.stats()
        assert held.offers_total == 1 and held.offered_keys_total == b.counter("pull_blocks")
        registry = c.router.metrics.registry
        assert registry.get_sample_value("pdproxy_kv_pulls_total", {"holder": "a"}) == 1
        # The next request of the same prefix finds it on b: b now holds it itself.
        async with c.client() as client:
            again = await complete(client, prompt(1024, " question two"))
        assert route_of(again)["reason"] != "pull"
        assert b.counter("pull_requests") == 1


async def test_free_producer_pulls_from_the_busy_one_and_supplies_the_consumer() -> None:
    roles = {"p0": "producer", "p1": "producer", "c0": "consumer"}
    always_pd = {"local_prefill": {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}}
    async with pull_cluster(tuple(roles), roles=roles, pull=PULL, router=always_pd) as c:
        text = prompt(1024, " question one")
        expected = await warm_holder(c, "p0", text)
        overload(c, "p0")
        async with c.client() as client:
            answer = await complete(client, text)
        route = route_of(answer)
        assert route["reason"] == "pull" and route["pull"]["target"] == "p1", route
        assert answer["choices"][0]["text"] == expected
        blocks = (len(text.encode()) - 1) // 16
        assert c.nodes["p1"].counter("pull_blocks") >= blocks
        assert c.nodes["c0"].counter("p2p_blocks_fetched") >= blocks  # from p1, as in any PD


@pytest.mark.parametrize("model", ["tiny"])
async def test_tiny_torch_workers_pull_output_equals_single_node(model: str) -> None:
    worker = {"model": model, "max_model_len": 1024, "num_pages": 128, "host_pages": 128}
    async with pull_cluster(pull={"enabled": True, "block_bytes": 32768}, worker=worker) as c:
        text = prompt(400, " what next?")
        expected = await warm_holder(c, "a", text)
        overload(c, "a")
        async with c.client() as client:
            answer = await complete(client, text)
        assert route_of(answer)["reason"] == "pull"
        assert answer["choices"][0]["text"] == expected
        b = c.nodes["b"]
        assert b.counter("pull_blocks") >= (len(text.encode()) - 1) // 16
        assert b.counter("pull_bytes") > 0 and b.counter("pull_failures") == 0


async def test_the_router_learns_the_link_speed_from_the_pullers_metrics() -> None:
    """With engine load on, the scrape of b's ``/metrics`` before and after its pull gives the
    planner b's own measurement: pulled bytes over the pull's wall seconds."""
    engine_load = {"engine_load": {"enabled": True, "interval_s": 0.05}}
    pull = {**PULL, "min_sample_bytes": 0}  # a sim pull is tens of KB
    async with pull_cluster(pull=pull, router=engine_load) as c:
        readings = c.router.scorer(EngineLoadScorer).readings
        for _ in range(400):  # the baseline: b scraped before it pulled
            reading = readings.latest("b")
            if reading is not None and reading.sample.pull_bytes == 0:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("b's pull counters were never scraped")
        link = c.router.scorer(PullScorer).link
        assert (link.samples, link.bytes_per_s) == (0, PULL_LINK_DEFAULT)
        text = prompt(1024, " question one")
        await warm_holder(c, "a", text)
        overload(c, "a")
        async with c.client() as client:
            answer = await complete(client, text)
        assert route_of(answer)["reason"] == "pull"
        stats = c.nodes["b"].worker.stats
        assert stats.pull_bytes > 0 and stats.pull_seconds > 0
        for _ in range(400):
            if link.samples:
                break
            await asyncio.sleep(0.02)
        assert link.samples == 1  # the first measurement is taken whole
        assert link.bytes_per_s == pytest.approx(stats.pull_bytes / stats.pull_seconds)
