"""One KV router per model inside the real proxy: each model follows only its own backends'
KV events, has its own seed (so two models' hashes never match, in memory or in Redis), block
size and metrics label; an adapter's router is seeded apart from its base; two models given one
seed are refused; a model learned from a backend gets its router on first use."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from kvtier.events import EventPublisher
from kvtier.keys import BlockHasher
from kvtier.residency.types import NodeId
from pdproxy.app import create_app
from pdproxy.errors import ConfigError
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.per_model import PerModelRouter
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

from .kv_helpers import BS, prompt_text, stored

SEED = "top"


def settings(backends: list[dict[str, Any]], **extra: Any) -> Any:
    served = extra.pop("served", {"alpha": {}, "beta": {}})
    return quick_settings(
        backends,
        router="kv",
        router_options={"model_seed": SEED, "block_size": BS, **extra.pop("options", {})},
        models={"served": served},
        **extra,
    )


def model_router(router: object, model: str) -> KvRouter:
    assert isinstance(router, PerModelRouter)
    kv = router.routers[model]
    assert isinstance(kv, KvRouter)
    return kv


async def test_each_model_follows_only_its_backends_events(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    pa0, pa1, pb0 = await fake("pa0"), await fake("pa1"), await fake("pb0")
    ca, cb = await fake("ca"), await fake("cb")
    prefix = prompt_text(2)
    async with (
        EventPublisher("tcp://127.0.0.1:*") as pub_a,
        EventPublisher("tcp://127.0.0.1:*") as pub_b,
    ):
        backends = [
            backend_entry(pa0, "producer", "p2p", models=["alpha"]),
            backend_entry(pa1, "producer", "p2p", models=["alpha"], events_endpoint=pub_a.endpoint),
            backend_entry(pb0, "producer", "p2p", models=["beta"], events_endpoint=pub_b.endpoint),
            backend_entry(ca, "consumer", "p2p", models=["alpha"]),
            backend_entry(cb, "consumer", "p2p", models=["beta"]),
        ]
        running = await proxy(settings(backends, options={"prediction_ttl_s": 0.05}))
        alpha = model_router(running.state.router, "alpha")
        beta = model_router(running.state.router, "beta")
        hashes_a = alpha.hasher.hash_tokens(list(prefix.encode()))
        hashes_b = beta.hasher.hash_tokens(list(prefix.encode()))
        assert not set(hashes_a) & set(hashes_b)  # one prompt, two models: no shared hash
        deadline = time.monotonic() + 5
        # The engines publish with their own hashes; the routers re-hash the token ids.
        while NodeId("pa1") not in await alpha.state.index.match(hashes_a) or NodeId(
            "pb0"
        ) not in await beta.state.index.match(hashes_b):
            assert time.monotonic() < deadline, "events never arrived"
            await pub_a.publish(stored(prefix))
            await pub_b.publish(stored(prefix))
            await asyncio.sleep(0.05)
        assert set(await alpha.state.index.match(hashes_a)) == {NodeId("pa1")}
        assert set(await beta.state.index.match(hashes_b)) == {NodeId("pb0")}
        async with running.client() as client:
            for i in range(3):
                body = {"model": "alpha", "prompt": prefix + f" q{i}", "max_tokens": 2}
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                await asyncio.sleep(0.06)  # predictions expire: the events decide
            metrics = (await client.get("/metrics")).text
    assert len(pa1.producer_legs()) == 3 and not pa0.producer_legs()
    assert 'pdproxy_kv_router_decisions_total{model="alpha",reason=' in metrics
    assert 'model="beta"' not in metrics.split("pdproxy_kv_router_decisions_total")[1][:200]


async def test_seeds_block_sizes_and_adapters_per_model(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    ca, cb = await fake("ca"), await fake("cb")
    backends = [
        backend_entry(ca, "consumer", "p2p", models=["alpha", "style"]),
        backend_entry(cb, "consumer", "p2p", models=["beta"]),
    ]
    served = {
        "alpha": {},
        "beta": {"router_options": {"block_size": 32, "model_seed": "beta-seed"}},
        "style": {"base": "alpha"},
    }
    running = await proxy(settings(backends, served=served))
    router = running.state.router
    seeds = {m: model_router(router, m).settings.model_seed for m in ("alpha", "beta", "style")}
    assert seeds == {
        "alpha": "top/model=alpha", "beta": "beta-seed", "style": "top/model=alpha/lora=style",
    }  # fmt: skip
    assert model_router(router, "beta").settings.block_size == 32
    assert model_router(router, "style").settings.block_size == BS
    prompt = prompt_text(4)
    async with running.client() as client:
        for model in ("alpha", "style"):
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    # alpha's request predicted its blocks on ca; the adapter's router never sees them as its
    # own: a base-model prefix is not a hit for the adapter.
    style = model_router(router, "style")
    alpha = model_router(router, "alpha")
    ids = list(prompt.encode())
    assert NodeId("ca") in await alpha.state.index.match(alpha.hasher.hash_tokens(ids))
    style_hashes = BlockHasher("top/model=alpha/lora=style", BS).hash_tokens(ids)
    assert await style.state.index.match(style_hashes) != {}  # its own prediction
    assert await alpha.state.index.match(style_hashes) == {}


def test_two_models_with_one_seed_are_refused() -> None:
    served = {
        "a": {"router_options": {"model_seed": "s"}},
        "b": {"router_options": {"model_seed": "s"}},
    }
    with pytest.raises(ConfigError, match="same model_seed"):
        create_app(settings([], served=served))


async def test_a_learned_model_gets_its_router_on_first_use(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    ca, cg = await fake("ca"), await fake("cg")
    ca.model, cg.model = "alpha", "gamma"
    backends = [
        backend_entry(ca, "consumer", "none", models=["alpha"]),
        backend_entry(cg, "consumer", "none"),  # its models are learned
    ]
    running = await proxy(
        settings(backends, served={"alpha": {}}, health={"enabled": True, "interval_s": 0.05})
    )
    router = running.state.router
    assert isinstance(router, PerModelRouter)
    deadline = time.monotonic() + 5
    while running.state.registry.get("cg").models is None:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    async with running.client() as client:
        body = {"model": "gamma", "prompt": "hello", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        assert (
            await client.post("/v1/completions", json={**body, "model": "x"})
        ).status_code == 404
    assert set(router.routers) == {"alpha", "gamma"}
    assert model_router(router, "gamma").settings.model_seed == "top/model=gamma"


async def test_models_never_share_keys_in_redis(
    fake: FakeFactory, proxy: ProxyFactory, redis_url: str
) -> None:
    ca, cb = await fake("ca"), await fake("cb")
    backends = [
        backend_entry(ca, "consumer", "p2p", models=["alpha"]),
        backend_entry(cb, "consumer", "p2p", models=["beta"]),
    ]
    running = await proxy(
        settings(backends, options={"index_url": redis_url, "redis_deadline_s": 1.0})
    )
    prompt = prompt_text(3)
    async with running.client() as client:
        for model in ("alpha", "beta"):
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
    router = running.state.router
    alpha, beta = model_router(router, "alpha"), model_router(router, "beta")
    ids = list(prompt.encode())
    assert set(await alpha.state.index.match(alpha.hasher.hash_tokens(ids))) == {NodeId("ca")}
    assert set(await beta.state.index.match(beta.hasher.hash_tokens(ids))) == {NodeId("cb")}
    assert await beta.state.index.match(alpha.hasher.hash_tokens(ids)) == {}
    client = aioredis.from_url(redis_url)
    try:
        keys: list[bytes] = await client.keys("*")
    finally:
        await client.aclose()
    # Block entries (predictions here) live under each model's own tag; the default router
    # (requests naming no model) keeps only its replica load under the top-level seed's.
    tags = {
        k[: k.index(b"}") + 1].decode() for k in keys if k.startswith(b"{") and k.endswith(b":pred")
    }
    assert tags == {"{pdproxy:top/model=alpha}", "{pdproxy:top/model=beta}"}, keys


async def test_a_forgotten_models_router_and_series_go(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    """Issue 30 finding 6: announced names became routers, admission buckets and metric labels
    that were never forgotten (80 announcements: 2,497 routers, /metrics 13 KiB -> 14.3 MiB).
    Once no backend lists a learned model, its router is closed and /metrics carries its label
    no more; configured models stay."""
    ca, cg = await fake("ca"), await fake("cg")
    ca.model, cg.model = "alpha", "gamma"
    admin = {"authorization": "Bearer admin"}
    running = await proxy(
        settings([backend_entry(ca, "consumer", "none", models=["alpha"])], served={"alpha": {}},
                 admin_key="admin")
    )  # fmt: skip
    router = running.state.router
    assert isinstance(router, PerModelRouter)
    async with running.client() as client:
        added = backend_entry(cg, "consumer", "none", models=["gamma"])
        assert (await client.post("/admin/backends", json=added, headers=admin)).status_code == 201
        for model in ("alpha", "gamma"):
            body = {"model": model, "prompt": "hello", "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body)).status_code == 200
        gamma = model_router(router, "gamma")
        before = (await client.get("/metrics")).text
        assert 'model="gamma"' in before
        assert (await client.delete("/admin/backends/cg", headers=admin)).status_code == 200
        body = {"model": "alpha", "prompt": "hello", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        after = (await client.get("/metrics")).text
    assert 'model="gamma"' not in after
    assert 'model="alpha"' in after
    assert set(router.routers) == {"alpha"}
    deadline = time.monotonic() + 5
    while not gamma.closed:
        assert time.monotonic() < deadline, "the forgotten model's router was never closed"
        await asyncio.sleep(0.02)
