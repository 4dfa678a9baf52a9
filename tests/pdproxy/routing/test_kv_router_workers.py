"""The KV-aware router against real reference workers (``sim``, 2 producers + 2 consumers):
real KV events over ZMQ, real P2P legs. The test drives the legs itself, as the proxy does."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvtier.residency.types import NodeId
from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import Worker
from pdproxy.routing.base import RequestOutcome, Role, RouteDecision, RouteRequest
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings

from .kv_helpers import Backend, prompt_text

pytestmark = pytest.mark.slow


@dataclass
class Node:
    backend: Backend
    client: httpx.AsyncClient
    worker: Worker


@contextlib.asynccontextmanager
async def sim_worker(name: str, role: str) -> AsyncIterator[Node]:
    settings = WorkerSettings(
        model="sim",
        role=role,  # type: ignore[arg-type]
        num_pages=100,
        host_pages=200,
        max_model_len=2048,
        events_endpoint="tcp://127.0.0.1:*",
        events_replay_endpoint="tcp://127.0.0.1:*",
        fetch_timeout_s=5.0,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            worker: Worker = app.state.worker
            yield Node(Backend(name, Role(role)), client, worker)


@dataclass
class Cluster:
    router: KvRouter
    nodes: dict[str, Node]

    @property
    def producers(self) -> list[Backend]:
        return [n.backend for n in self.nodes.values() if n.backend.role is Role.PRODUCER]

    @property
    def consumers(self) -> list[Backend]:
        return [n.backend for n in self.nodes.values() if n.backend.role is Role.CONSUMER]

    async def request(self, prompt: str) -> RouteDecision:
        """Route, run the legs (P2P dialect) on the chosen nodes, report the outcome."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        d = await self.router.route(
            RouteRequest(uuid.uuid4().hex, "completions", body), self.producers, self.consumers
        )
        consumer = self.nodes[d.consumers[0].name]
        params: dict[str, Any] | None = None
        if d.producers:
            kid = uuid.uuid4().hex
            leg = {
                **body,
                "max_tokens": 1,
                "kv_transfer_params": {"remote_decoder": {"kv_request_id": kid}},
            }
            resp = await self.nodes[d.producers[0].name].client.post("/v1/completions", json=leg)
            assert resp.status_code == 200, resp.text
            answer = resp.json()["kv_transfer_params"]
            params = {
                "remote_prefiller": {
                    k: answer[k] for k in ("kv_request_id", "remote_host", "remote_port")
                }
            }
        resp = await consumer.client.post(
            "/v1/completions", json={**body, "kv_transfer_params": params} if params else body
        )
        assert resp.status_code == 200, resp.text
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        await self.router.finished(
            d,
            RequestOutcome(
                d.producers[0].name if d.producers else None, consumer.backend.name, True, cached
            ),
        )
        return d


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def cluster(**router_options: Any) -> AsyncIterator[Cluster]:
    async with contextlib.AsyncExitStack() as stack:
        nodes: dict[str, Node] = {}
        for name, role in (
            ("p0", "producer"),
            ("p1", "producer"),
            ("c0", "consumer"),
            ("c1", "consumer"),
        ):
            nodes[name] = await stack.enter_async_context(sim_worker(name, role))
        some = next(iter(nodes.values())).worker
        events, replay = {}, {}
        for name, node in nodes.items():
            publisher = node.worker.events.publisher
            assert publisher is not None
            events[name] = publisher.endpoint
            replay[name] = publisher.replay_endpoint
        settings = KvRouterSettings.model_validate(
            {
                "model_seed": some.settings.hash_seed,
                "block_size": some.settings.block_size,
                "events": events,
                "replay": replay,
                "prediction_ttl_s": 0.05,  # so these tests see what the events say
                **router_options,
            }
        )
        router = build_kv_router(settings, metrics_registry=CollectorRegistry())
        await router.start()
        stack.push_async_callback(router.close)
        yield Cluster(router, nodes)


async def holds(router: KvRouter, node: str, prompt: str, blocks: int) -> bool:
    hashes = router.hasher.hash_tokens(list(prompt.encode()))
    m = (await router.state.index.match(hashes)).get(NodeId(node))
    return m is not None and m.total >= blocks


async def test_second_request_follows_the_prefix_and_eviction_moves_it() -> None:
    always_pd = {"local_prefill": {"max_suffix_tokens": 0, "min_hit_ratio": 1.0}}
    async with cluster(**always_pd) as c:
        prefix = prompt_text(1, length=1024)
        first = await c.request(prefix + " first question")
        holder = first.producers[0].name
        await eventually(lambda: holds(c.router, holder, prefix, 64))
        await asyncio.sleep(0.06)  # the first decision's predictions are gone: events decide
        second = await c.request(prefix + " second question")
        assert second.producers[0].name == holder
        assert second.reason == "kv-prefix"
        row = next(r for r in second.explain["producers"] if r["name"] == holder)
        assert row["gpu"] >= 64
        # The holder evicts the prefix from its device and host tiers: other prompts run as
        # producer legs (which store to the host tier) and their supplies are released.
        mid_eviction = second
        for i in range(8):
            kid = uuid.uuid4().hex
            leg = {
                "prompt": prompt_text(100 + i, length=1024),
                "max_tokens": 1,
                "kv_transfer_params": {"remote_decoder": {"kv_request_id": kid}},
            }
            node = c.nodes[holder].client
            assert (await node.post("/v1/completions", json=leg)).status_code == 200
            assert (
                await node.post("/v1/kv/release", json={"kv_request_id": kid})
            ).status_code == 200
            if i == 0:
                await eventually(lambda: gpu_below(c.router, holder, prefix, 64))
                mid_eviction = await c.request(prefix + " while host-only")
        # Off the GPU but still in the host tier: still the holder, credited at host rate.
        assert mid_eviction.producers[0].name == holder
        row = next(r for r in mid_eviction.explain["producers"] if r["name"] == holder)
        assert row["gpu"] < 64 and row["cpu"] >= 64
        await eventually(lambda: _not(holds(c.router, holder, prefix, 1)))
        third = await c.request(prefix + " third question")
        assert third.reason == "load"  # nobody holds it any more: the events said so
        row = next(r for r in third.explain["producers"] if r["name"] == holder)
        assert row["total"] == 0
        # Serving it stored the prefix on the third request's producer: the next one follows.
        new_holder = third.producers[0].name
        await eventually(lambda: holds(c.router, new_holder, prefix, 64))
        await asyncio.sleep(0.06)
        fourth = await c.request(prefix + " fourth question")
        assert fourth.producers[0].name == new_holder and fourth.reason == "kv-prefix"
        row = next(r for r in fourth.explain["producers"] if r["name"] == new_holder)
        assert row["total"] >= 64


async def test_consumer_that_holds_the_prefix_serves_alone_and_telemetry_agrees() -> None:
    async with cluster() as c:
        prefix = prompt_text(2, length=1024)
        first = await c.request(prefix + " q1")
        assert first.producers  # cold and long: disaggregated
        consumer = first.consumers[0].name
        await eventually(lambda: holds(c.router, consumer, prefix, 64))
        await asyncio.sleep(0.06)
        second = await c.request(prefix + " q2")
        assert second.consumers[0].name == consumer
        assert second.producers == [] and second.reason == "short-suffix"
        # The engine's cached_tokens matched the router's prediction: zero drift.
        labels = {"mode": "alone", "le": "0.0"}
        registry = c.router.metrics.registry
        drift_le_0 = registry.get_sample_value(
            "pdproxy_kv_router_cached_tokens_drift_bucket", labels
        )
        drift_le_m1 = registry.get_sample_value(
            "pdproxy_kv_router_cached_tokens_drift_bucket", {"mode": "alone", "le": "-1.0"}
        )
        assert drift_le_0 == 1 and drift_le_m1 == 0


async def gpu_below(router: KvRouter, node: str, prompt: str, blocks: int) -> bool:
    hashes = router.hasher.hash_tokens(list(prompt.encode()))
    m = (await router.state.index.match(hashes)).get(NodeId(node))
    return m is not None and m.gpu < blocks


async def _not(value: Awaitable[bool]) -> bool:
    return not await value
