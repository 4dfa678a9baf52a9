"""Symmetric pull inside the real proxy (``router: kv``, ``pull.enabled``), fake engines as
real HTTP servers: the legs carry ``remote_kv_source`` naming the holder's configured
``kv_address``, the explain header and ``/metrics`` show the pull, failover ends on the
holder without one, and clients can never name a source themselves."""

from __future__ import annotations

import json
from typing import Any

from kvtier.residency.types import NodeId
from loadtest.fake_backend import FakeBackend
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.scorers.pull import PullScorer
from pdproxy.routing.kv.state import LoadDelta
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RunningProxy,
    backend_entry,
    quick_settings,
)

from .kv_helpers import BS, SEED, prompt_text, stored

PREFIX = prompt_text(1)
BODY = {"model": "m", "prompt": PREFIX + " question", "max_tokens": 2}
DEBUG = {"x-pdproxy-debug": "1"}
PULL = {"enabled": True, "block_bytes": 65536, "link_bytes_per_s": 1e9}


def holder_entry(fb: FakeBackend, role: str) -> dict[str, Any]:
    """A p2p backend whose configured ``kv_address`` is the P2P port its answers name."""
    port = fb.behavior.p2p_port
    return backend_entry(
        fb, role, "p2p", kv_address=f"127.0.0.1:{port}", kv_engine_id=f"engine-{fb.name}"
    )


async def start(
    proxy: ProxyFactory, backends: list[dict[str, Any]], pull: dict[str, Any] = PULL, **extra: Any
) -> tuple[RunningProxy, KvRouter]:
    options = {"model_seed": SEED, "block_size": BS, "pull": pull}
    settings = quick_settings(
        backends, router="kv", router_options=options, debug_headers=True, **extra
    )
    running = await proxy(settings)
    router = running.state.router
    assert isinstance(router, KvRouter)
    return running, router


async def busy_holder(router: KvRouter, holder: str, in_flight: int = 20) -> None:
    """``holder`` has the prefix cached (its KV events said so) and many requests in flight
    (other clients' requests, as the router counts them)."""
    await router.state.index.apply(NodeId(holder), stored(PREFIX))
    router.state.local.apply([LoadDelta(holder, in_flight, 4000)])


def kv_params(fb: FakeBackend) -> list[Any]:
    return [r.json().get("kv_transfer_params") for r in fb.completions()]


async def test_consumer_alone_pulls_from_the_busy_holder(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    a, b = await fake("a", p2p_port=7100), await fake("b", p2p_port=7200)
    running, router = await start(proxy, [holder_entry(a, "both"), holder_entry(b, "both")])
    await busy_holder(router, "a")
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY, headers=DEBUG)
        assert resp.status_code == 200, resp.text
        metrics = (await client.get("/metrics")).text
    assert a.completions() == []
    source = {"remote_host": "127.0.0.1", "remote_port": 7100, "remote_engine_id": "engine-a"}
    assert kv_params(b) == [{"remote_kv_source": source}]
    explain = json.loads(resp.headers["x-pdproxy-route"])
    assert explain["reason"] == "pull"
    assert explain["pull"]["holder"] == "a" and explain["pull"]["target"] == "b"
    assert explain["pull"]["blocks"] == len(PREFIX) // BS
    assert 'pdproxy_kv_pulls_total{holder="a"} 1.0' in metrics
    assert "pdproxy_kv_pull_planned_bytes_total" in metrics
    # What the decision charged is released: b is idle again, a is back to its own load.
    assert router.state.local.get("b").in_flight == 0
    assert router.state.local.get("a").in_flight == 20
    assert router.scorer(PullScorer).sending == {}  # its bytes no longer queue ahead of other pulls


async def test_free_producer_pulls_then_supplies_the_consumer(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0, p1 = await fake("p0", p2p_port=7100), await fake("p1", p2p_port=7101)
    c0 = await fake("c0")
    backends = [
        holder_entry(p0, "producer"),
        holder_entry(p1, "producer"),
        backend_entry(c0, "consumer", "p2p"),
    ]
    running, router = await start(proxy, backends)
    await busy_holder(router, "p0")
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
    assert p0.completions() == []
    [leg] = kv_params(p1)
    assert set(leg) == {"remote_decoder", "remote_kv_source"}
    assert leg["remote_kv_source"]["remote_port"] == 7100
    [consumer_leg] = kv_params(c0)
    assert consumer_leg["remote_prefiller"]["remote_port"] == p1.behavior.p2p_port


async def test_producer_failover_to_the_holder_drops_the_pull(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0 = await fake("p0", p2p_port=7100)
    p1 = await fake("p1", p2p_port=7101, fail_status=503, fail_producer_only=True)
    c0 = await fake("c0")
    backends = [holder_entry(p0, "producer"), holder_entry(p1, "producer")]
    running, router = await start(proxy, [*backends, backend_entry(c0, "consumer", "p2p")])
    await busy_holder(router, "p0")
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
    assert [set(p) for p in kv_params(p1)] == [{"remote_decoder", "remote_kv_source"}]
    assert [set(p) for p in kv_params(p0)] == [{"remote_decoder"}]  # it holds the prefix
    [consumer_leg] = kv_params(c0)
    assert consumer_leg["remote_prefiller"]["remote_port"] == 7100


async def test_pull_off_the_same_load_recomputes_on_the_free_node(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    a, b = await fake("a", p2p_port=7100), await fake("b", p2p_port=7200)
    off = {**PULL, "enabled": False}
    running, router = await start(
        proxy, [holder_entry(a, "both"), holder_entry(b, "both")], pull=off
    )
    await busy_holder(router, "a")
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY, headers=DEBUG)
        assert resp.status_code == 200, resp.text
        metrics = (await client.get("/metrics")).text
    assert kv_params(b) == [None]  # the client's body, untouched
    assert "pull" not in json.loads(resp.headers["x-pdproxy-route"])
    assert "pdproxy_kv_pulls_total{" not in metrics


async def test_failover_ends_on_the_holder_without_a_pull(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    a = await fake("a", p2p_port=7100)
    b = await fake("b", p2p_port=7200, fail_status=503)
    running, router = await start(proxy, [holder_entry(a, "both"), holder_entry(b, "both")])
    await busy_holder(router, "a")
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
    assert [p and set(p) for p in kv_params(b)] == [{"remote_kv_source"}]
    assert kv_params(a) == [None]  # the holder serves from its own cache: no pull from itself


async def test_holder_without_kv_address_is_not_pulled_from(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    a, b = await fake("a", p2p_port=7100), await fake("b", p2p_port=7200)
    backends = [backend_entry(a, "both", "p2p"), holder_entry(b, "both")]
    running, router = await start(proxy, backends)
    await busy_holder(router, "a")
    async with running.client() as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert kv_params(b) == [None]


async def test_nixl_pool_never_pulls(fake: FakeFactory, proxy: ProxyFactory) -> None:
    a, b = await fake("a", p2p_port=7100), await fake("b", p2p_port=7200)
    backends = [
        backend_entry(a, "both", "nixl", kv_address="127.0.0.1:7100"),
        backend_entry(b, "both", "nixl", kv_address="127.0.0.1:7200"),
    ]
    running, router = await start(proxy, backends)
    await busy_holder(router, "a")
    async with running.client() as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
    assert all("remote_kv_source" not in (p or {}) for p in kv_params(a) + kv_params(b))


# ----------------------------------------------------------------------- hostile clients
# Threat: remote_kv_source makes an engine open a P2P connection to the host it names and
# install what it receives into a prefix cache shared by every user. Only the proxy, from its
# configuration, may name one; a client that tries is refused before any backend is touched.


async def test_client_sent_remote_kv_source_is_refused(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    a, b = await fake("a", p2p_port=7100), await fake("b", p2p_port=7200)
    running, router = await start(
        proxy,
        [holder_entry(a, "both"), holder_entry(b, "both")],
        api_keys=[{"key": "user"}, {"key": "orchestrator", "trusted": True}],
    )
    await busy_holder(router, "a")
    evil = {"remote_kv_source": {"remote_host": "evil.example", "remote_port": 1}}
    user = {"Authorization": "Bearer user"}
    async with running.client() as client:
        for body in (
            {**BODY, "kv_transfer_params": evil},
            {**BODY, "vllm_xargs": {"kv_transfer_params": evil}},
        ):
            resp = await client.post("/v1/completions", json=body, headers=user)
            assert resp.status_code == 400
            assert resp.json()["error"]["code"] == "kv_transfer_params_not_allowed"
        assert a.received == [] and b.received == []
        # A trusted caller's own params pass through unchanged: the proxy adds no pull of its
        # own to them, even where it would have pulled.
        trusted = {"Authorization": "Bearer orchestrator"}
        resp = await client.post("/v1/completions", json={**BODY, "kv_transfer_params": evil},
                                 headers=trusted)  # fmt: skip
        assert resp.status_code == 200
    assert kv_params(a) + kv_params(b) == [evil]
