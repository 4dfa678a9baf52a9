"""Many models behind one proxy, against fake engines: requests reach only backends serving
their model (configured or learned from ``/v1/models``), unknown models get OpenAI's 404, a
known model with no routable backend a 503, ``/v1/models`` lists each model once, LoRA
adapters go where they are loaded, and per-model admission keeps a hot model from starving
another, with metric labels only for models the proxy knows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web
from pydantic import ValidationError

from loadtest.fake_backend import FakeBackend
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.models import ModelCatalog, ModelLearner, ModelList
from pdproxy.settings import BackendConfig, BreakerSettings, TimeoutSettings, UpstreamSettings
from pdproxy.settings.models import ModelsSettings
from pdproxy.upstream.client import Upstream
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    backend_entry,
    eventually,
    quick_settings,
)


def completion(model: object, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 2, **extra}


def models_seen(fb: FakeBackend) -> set[object]:
    return {r.json().get("model") for r in fb.completions()}


async def two_model_pool(fake: FakeFactory) -> tuple[list[FakeBackend], list[dict[str, Any]]]:
    fakes = [await fake(n) for n in ("pa", "ca", "pb", "cb")]
    models = {"pa": ["alpha"], "ca": ["alpha"], "pb": ["beta"], "cb": ["beta"]}
    entries = [
        backend_entry(fb, "producer" if fb.name[0] == "p" else "consumer", models=models[fb.name])
        for fb in fakes
    ]
    return fakes, entries


async def test_requests_reach_only_backends_serving_their_model(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    fakes, entries = await two_model_pool(fake)
    px = await proxy(quick_settings(entries))
    async with px.client() as c:
        answers = await asyncio.gather(
            *(c.post("/v1/completions", json=completion(m)) for m in ["alpha", "beta"] * 8)
        )
    assert [r.status_code for r in answers] == [200] * 16
    pa, ca, pb, cb = fakes
    assert models_seen(pa) == models_seen(ca) == {"alpha"}
    assert models_seen(pb) == models_seen(cb) == {"beta"}
    assert len(ca.consumer_legs()) == len(cb.consumer_legs()) == 8


async def test_unknown_model_is_openais_404_and_bad_model_a_400(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    fakes, entries = await two_model_pool(fake)
    px = await proxy(quick_settings(entries))
    async with px.client() as c:
        resp = await c.post("/v1/completions", json=completion("gpt-nope"))
        assert resp.status_code == 404
        assert resp.json()["error"] == {
            "message": "The model `gpt-nope` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "code": "model_not_found",
        }
        huge = await c.post("/v1/chat/completions", json={"model": "x" * 5000, "messages": []})
        assert huge.status_code == 404 and len(huge.json()["error"]["message"]) < 400
        bad = await c.post("/v1/completions", json=completion(["alpha"]))
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_model"
    assert all(not fb.completions() for fb in fakes)


async def test_known_model_without_a_routable_backend_is_503(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    fakes, entries = await two_model_pool(fake)
    px = await proxy(quick_settings(entries))
    cb = px.state.registry.get("cb")
    assert cb is not None
    cb.draining = True
    async with px.client() as c:
        resp = await c.post("/v1/completions", json=completion("beta"))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert (await c.post("/v1/completions", json=completion("alpha"))).status_code == 200
    assert not fakes[3].completions()


async def test_models_are_learned_on_health_checks_and_refreshed(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    ca, cb = await fake("ca"), await fake("cb")
    ca.model, cb.model = "alpha", "beta"
    settings = quick_settings(
        [backend_entry(ca, "consumer", "none"), backend_entry(cb, "consumer", "none")],
        health={"enabled": True, "interval_s": 0.05},
    )
    px = await proxy(settings)
    registry = px.state.registry
    await eventually(lambda: all(b.models is not None for b in registry.all()))
    async with px.client() as c:
        for model, fb in (("alpha", ca), ("beta", cb)):
            assert (await c.post("/v1/completions", json=completion(model))).status_code == 200
            assert models_seen(fb) == {model}
        assert (await c.post("/v1/completions", json=completion("gamma"))).status_code == 404
        cb.model = "gamma"  # the engine now serves another model: picked up by the next check
        await eventually(lambda: registry.get("cb").serves_model("gamma"))  # type: ignore[union-attr]
        assert (await c.post("/v1/completions", json=completion("gamma"))).status_code == 200
        assert (await c.post("/v1/completions", json=completion("beta"))).status_code == 404


async def test_v1_models_lists_each_model_once(fake: FakeFactory, proxy: ProxyFactory) -> None:
    fakes = [await fake(n) for n in ("c1", "c2", "c3")]
    for fb, model in zip(fakes, ("alpha", "alpha", "beta"), strict=True):
        fb.model = model
    px = await proxy(quick_settings([backend_entry(fb, "consumer", "none") for fb in fakes]))
    async with px.client() as c:
        data = (await c.get("/v1/models")).json()["data"]
    assert sorted(m["id"] for m in data) == ["alpha", "beta"]


async def test_adapter_goes_where_it_is_loaded_or_to_its_base_on_demand(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    loaded, plain = await fake("loaded"), await fake("plain")
    entries = [
        backend_entry(loaded, "consumer", "none", models=["alpha", "style"]),
        backend_entry(plain, "consumer", "none", models=["alpha"]),
    ]
    px = await proxy(quick_settings(entries, models={"served": {"style": {"base": "alpha"}}}))
    async with px.client() as c:
        for _ in range(6):
            assert (await c.post("/v1/completions", json=completion("style"))).status_code == 200
        assert models_seen(loaded) == {"style"} and not plain.completions()
        px.state.registry.get("loaded").draining = True  # type: ignore[union-attr]
        assert (await c.post("/v1/completions", json=completion("style"))).status_code == 503
    on_demand = quick_settings(
        entries, models={"served": {"style": {"base": "alpha", "load_on_demand": True}}}
    )
    px2 = await proxy(on_demand)
    px2.state.registry.get("loaded").draining = True  # type: ignore[union-attr]
    async with px2.client() as c:
        assert (await c.post("/v1/completions", json=completion("style"))).status_code == 200
    assert models_seen(plain) == {"style"}


async def test_a_hot_model_does_not_starve_another(fake: FakeFactory, proxy: ProxyFactory) -> None:
    hot, cold = await fake("hot", hang=True), await fake("cold")
    settings = quick_settings(
        [
            backend_entry(hot, "consumer", "none", models=["alpha"]),
            backend_entry(cold, "consumer", "none", models=["beta"]),
        ],
        admission={"max_concurrent": 4, "queue_size": 8},
        models={"default_limits": {"max_concurrent": 2, "queue_size": 0}},
    )
    px = await proxy(settings)
    async with px.client() as c:
        stuck = [
            asyncio.ensure_future(c.post("/v1/completions", json=completion("alpha")))
            for _ in range(2)
        ]
        await eventually(lambda: len(hot.completions()) == 2)
        refused = await c.post("/v1/completions", json=completion("alpha"))
        assert refused.status_code == 429 and "retry-after" in refused.headers
        served = await asyncio.gather(
            *(c.post("/v1/completions", json=completion("beta")) for _ in range(2))
        )
        assert [r.status_code for r in served] == [200, 200]
        metrics = (await c.get("/metrics")).text
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)
    assert 'pdproxy_model_in_flight{model="alpha"} 2.0' in metrics
    assert 'pdproxy_model_admission_refused_total{model="alpha"} 1.0' in metrics
    assert 'pdproxy_model_requests_total{model="beta",status="200"} 2.0' in metrics
    await eventually(lambda: ("alpha", 0, 0) in px.state.model_admission.snapshot())


async def test_metric_labels_never_take_client_strings(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    c0 = await fake("c0")
    px = await proxy(quick_settings([backend_entry(c0, "consumer", "none")]))  # list unknown
    async with px.client() as c:
        for i in range(5):
            resp = await c.post("/v1/completions", json=completion(f"client-chosen-{i}"))
            assert resp.status_code == 200  # a backend whose list is unknown may serve it
        metrics = (await c.get("/metrics")).text
    assert "client-chosen" not in metrics
    assert 'pdproxy_model_requests_total{model="other",status="200"} 5.0' in metrics


def test_limits_that_could_take_every_slot_are_refused() -> None:
    with pytest.raises(ValidationError, match="starve"):
        quick_settings(
            [],
            admission={"max_concurrent": 4},
            models={"served": {"alpha": {"limits": {"max_concurrent": 2, "queue_size": 2}}}},
        )
    with pytest.raises(ValidationError, match="model names"):
        BackendConfig(name="b", url="http://h", role="consumer", models=("bad\nname",))
    with pytest.raises(ValidationError, match="load_on_demand"):
        ModelsSettings.model_validate({"served": {"a": {"load_on_demand": True}}})


def test_catalog_learns_adapters_and_bounds_what_it_learns() -> None:
    registry = BackendRegistry(BreakerSettings())
    b = registry.add(BackendConfig(name="b", url="http://h", role="consumer"))
    catalog = ModelCatalog(ModelsSettings(max_learned=3), registry)
    assert catalog.resolve({"model": "anything"}) is not None  # list unknown: any model
    catalog.learn(
        b,
        [
            {"id": "base"},
            {"id": "ad", "parent": "base"},
            {"id": 7},
            {"id": "x\x00"},
            {"id": "third"},
            {"id": "fourth"},
        ],
    )
    assert b.models is not None and b.models.names == {"base", "ad", "third"}
    assert catalog.known() == ["base", "ad", "third"]
    ref = catalog.resolve({"model": "ad"})
    assert ref is not None and ref.base == "base" and ref.label == "ad"
    assert catalog.resolve({}) is None
    with pytest.raises(Exception, match="does not exist"):
        catalog.resolve({"model": "fourth"})


# -- issue 30, finding 8: a backend's model list, played by an attacker


def test_one_backend_cannot_take_every_learned_name_and_junk_is_forgotten() -> None:
    """One backend listing 256 junk names filled the global ``max_learned`` and a real new
    adapter on another backend was a 404 until restart. A backend now learns at most
    ``max_learned_per_backend`` names, and names no backend lists any more are forgotten."""
    registry = BackendRegistry(BreakerSettings())
    junk = registry.add(BackendConfig(name="junk", url="http://h1", role="consumer"))
    real = registry.add(BackendConfig(name="real", url="http://h2", role="consumer"))
    catalog = ModelCatalog(ModelsSettings(), registry)
    catalog.learn(junk, [{"id": f"junk-{i}"} for i in range(256)])
    catalog.learn(real, [{"id": "base"}, {"id": "new-adapter", "parent": "base"}])
    ref = catalog.resolve({"model": "new-adapter"})
    assert ref is not None and ref.label == "new-adapter" and ref.base == "base"
    catalog.learn(junk, [{"id": "base"}])  # the junk is gone from its list
    assert sorted(catalog.known()) == ["base", "new-adapter"]
    registry.remove("real")
    assert catalog.known() == ["base"]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class _ModelsBackend:
    """One backend whose ``/v1/models`` a handler answers, and the proxy side that learns it."""

    registry: BackendRegistry
    backend: Backend
    catalog: ModelCatalog
    learner: ModelLearner
    upstream: Upstream


@contextlib.asynccontextmanager
async def _models_backend(handler: Handler) -> AsyncIterator[_ModelsBackend]:
    app = web.Application()
    app.router.add_get("/v1/models", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    upstream = Upstream(TimeoutSettings(), UpstreamSettings())
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        registry = BackendRegistry(BreakerSettings())
        backend = registry.add(
            BackendConfig(name="b", url=f"http://127.0.0.1:{port}", role="consumer")
        )
        catalog = ModelCatalog(ModelsSettings(), registry)
        yield _ModelsBackend(registry, backend, catalog, ModelLearner(catalog, upstream), upstream)
    finally:
        await upstream.close()
        await runner.cleanup()


async def test_an_oversized_model_list_is_not_parsed() -> None:
    """A backend answered ``/v1/models`` with 45 MiB and the proxy parsed it on the event loop
    (``/health`` stalled 1.46 s per poll). A list past ``models.max_list_bytes`` (1 MiB) is
    not parsed: the backend keeps the list it had."""
    entries = [{"id": f"m-{i:07d}", "object": "model"} for i in range(40_000)]  # ~1.3 MiB
    big = orjson.dumps({"object": "list", "data": entries})
    assert len(big) > 2**20
    answers = [b'{"object": "list", "data": [{"id": "small"}]}', big]

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=answers[0], content_type="application/json")

    async with _models_backend(models) as mb:
        backend, catalog, learner = mb.backend, mb.catalog, mb.learner
        await learner(backend)
        assert backend.models is not None and backend.models.names == {"small"}
        answers.pop(0)
        await learner(backend)
        assert backend.models.names == {"small"}
        assert catalog.known() == ["small"]


async def test_a_huge_model_list_is_read_no_further_than_the_cap() -> None:
    """Attacker: a backend answers ``/v1/models`` with 48 MiB. The list was read whole (up to
    ``upstream.max_answer_bytes``, 64 MiB) before its size was checked. Reading stops at
    ``models.max_list_bytes``: the backend's writes fail well short of the body, the proxy's
    memory does not grow by the body's size, and the list it had is kept (learner and
    ``GET /v1/models`` alike)."""
    size = 48 << 20
    piece = b" " * (256 << 10)
    sent = [0]
    huge = [False]

    async def models(request: web.Request) -> web.StreamResponse:
        if not huge[0]:
            return web.Response(
                body=b'{"object": "list", "data": [{"id": "small"}]}',
                content_type="application/json",
            )
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        resp.content_length = size
        await resp.prepare(request)
        try:
            while sent[0] < size:
                await resp.write(piece)
                sent[0] += len(piece)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async with _models_backend(models) as mb:
        registry, backend, catalog, learner, upstream = (
            mb.registry,
            mb.backend,
            mb.catalog,
            mb.learner,
            mb.upstream,
        )
        await learner(backend)
        assert backend.models is not None and backend.models.names == {"small"}
        listing = ModelList(registry, upstream, cache_s=0.0, max_bytes=2**20)
        huge[0] = True
        await learner(backend)
        assert backend.models.names == {"small"}
        assert catalog.known() == ["small"]
        await asyncio.sleep(0.2)  # the backend notices the dropped connection
        assert sent[0] < 16 << 20, f"the backend wrote {sent[0] >> 20} MiB of a 48 MiB list"
        sent[0] = 0
        assert orjson.loads(await listing.body())["data"] == []
        await asyncio.sleep(0.2)
        assert sent[0] < 16 << 20, f"the backend wrote {sent[0] >> 20} MiB of a 48 MiB list"
        await listing.close()
