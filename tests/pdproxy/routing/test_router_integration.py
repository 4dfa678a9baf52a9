"""The router inside the proxy: its metrics on ``/metrics``, its decision time in
``Server-Timing``, and the opt-in ``x-pdproxy-route`` debug header."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.fake_backend import FakeBackend
from pdproxy.routing.base import BackendView, RequestOutcome, RouteDecision, RouteRequest
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.simple import RoundRobinRouter
from pdproxy.settings import ProxySettings
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

PROMPT = "[0001] system prompt of this group. " * 8
BODY: dict[str, object] = {"model": "m", "prompt": PROMPT + "question?", "max_tokens": 2}
PROMPT_TOKENS = len((PROMPT + "question?").encode())  # the byte tokenizer: one per byte
DEBUG = {"x-pdproxy-debug": "1"}


async def pd_pair(fake: FakeFactory) -> tuple[FakeBackend, FakeBackend, list[dict[str, Any]]]:
    p0, c0 = await fake("p0"), await fake("c0")
    return p0, c0, [backend_entry(p0, "producer", "p2p"), backend_entry(c0, "consumer", "p2p")]


def kv(backends: list[dict[str, Any]], **overrides: Any) -> ProxySettings:
    # max_suffix_tokens=0: every prompt with an uncached suffix gets a producer leg.
    options = {"model_seed": "m", "block_size": 16, "local_prefill": {"max_suffix_tokens": 0}}
    return quick_settings(backends, router="kv", router_options=options, **overrides)


def server_timing(resp: httpx.Response) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in resp.headers["server-timing"].split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Metric samples by sample name, from the Prometheus text format."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


# -------------------------------------------------------------------------- /metrics


async def test_metrics_include_the_kv_routers_own(fake: FakeFactory, proxy: ProxyFactory) -> None:
    p0, c0, backends = await pd_pair(fake)
    running = await proxy(kv(backends))
    router = running.state.router
    assert isinstance(router, KvRouter)
    assert router.metrics.registry is running.state.metrics.registry
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
        assert resp.status_code == 200, resp.text
        scraped = samples((await client.get("/metrics")).text)
    [(labels, count)] = scraped["pdproxy_kv_router_decisions_total"]
    assert count == 1 and labels["reason"]
    [(_, route_count)] = scraped["pdproxy_kv_router_route_seconds_count"]
    assert route_count == 1
    [(_, prompt_tokens)] = scraped["pdproxy_kv_router_prompt_tokens_total"]
    assert prompt_tokens == PROMPT_TOKENS
    # The proxy's own metrics are still there, on the same page.
    [(req_labels, requests)] = scraped["pdproxy_requests_total"]
    assert requests == 1 and req_labels["status"] == "200"
    assert len(p0.producer_legs()) == 1 and len(c0.consumer_legs()) == 1


async def test_simple_router_metrics_page_has_no_kv_router_series(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(quick_settings(backends))
    async with running.client() as client:
        assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        text = (await client.get("/metrics")).text
    assert "pdproxy_requests_total" in text and "pdproxy_kv_router" not in text


# -------------------------------------------------------------------------- Server-Timing


class SlowDecidingRouter:
    """Round-robin that reports a fixed decision time, as a router that times itself does."""

    def __init__(self, route_time_s: float) -> None:
        self._inner = RoundRobinRouter()
        self._route_time_s = route_time_s

    async def start(self) -> None:
        return None

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[BackendView],
        consumers: Sequence[BackendView],
    ) -> RouteDecision:
        decision = await self._inner.route(request, producers, consumers)
        return dataclasses.replace(decision, route_time_s=self._route_time_s)

    async def finished(self, decision: RouteDecision, outcome: RequestOutcome) -> None:
        return None

    async def close(self) -> None:
        return None


async def test_server_timing_route_is_the_routers_decision_time(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(quick_settings(backends), router=SlowDecidingRouter(0.25))
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    assert server_timing(resp)["route"] == 250.0  # reported, not measured (the call is instant)


async def test_server_timing_route_matches_the_kv_routers_histogram(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(kv(backends))
    router = running.state.router
    assert isinstance(router, KvRouter)
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    route_s = router.metrics.registry.get_sample_value("pdproxy_kv_router_route_seconds_sum")
    assert route_s is not None and route_s > 0
    timing = server_timing(resp)
    assert timing["route"] == round(route_s * 1000, 3)
    assert {"route", "producer", "consumer_fb"} <= set(timing)


async def test_server_timing_route_is_measured_for_routers_that_report_none(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(quick_settings(backends))
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200
    assert 0 < server_timing(resp)["route"] < 1000


# -------------------------------------------------------------------------- debug header


@pytest.mark.parametrize("stream", [False, True])
async def test_kv_route_explained_when_allowed_and_asked(
    fake: FakeFactory, proxy: ProxyFactory, stream: bool
) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(kv(backends, debug_headers=True))
    async with running.client() as client:
        resp = await client.post("/v1/completions", json={**BODY, "stream": stream}, headers=DEBUG)
        plain = await client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200, resp.text
    explained = json.loads(resp.headers["x-pdproxy-route"])
    assert explained["index"] == "memory"
    assert explained["reason"]
    assert [row["name"] for row in explained["consumers"]] == ["c0"]
    assert [row["name"] for row in explained["producers"]] == ["p0"]
    assert explained["prompt_tokens"] == PROMPT_TOKENS
    assert "x-pdproxy-route" not in plain.headers  # allowed, but this client did not ask


async def test_simple_route_explained_by_its_reason(fake: FakeFactory, proxy: ProxyFactory) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(quick_settings(backends, router="least_loaded", debug_headers=True))
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY, headers={"x-pdproxy-debug": "true"})
    assert resp.status_code == 200
    assert json.loads(resp.headers["x-pdproxy-route"]) == {"reason": "least-loaded"}


async def test_route_explained_on_an_upstream_failure_too(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p0, c0 = await fake("p0"), await fake("c0", fail_status=500)
    backends = [backend_entry(p0, "producer", "p2p"), backend_entry(c0, "consumer", "p2p")]
    running = await proxy(kv(backends, debug_headers=True))
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY, headers=DEBUG)
    assert resp.status_code >= 500
    assert [r["name"] for r in json.loads(resp.headers["x-pdproxy-route"])["consumers"]] == ["c0"]


@pytest.mark.parametrize("router", ["kv", "round_robin"])
async def test_route_never_explained_unless_allowed(
    fake: FakeFactory, proxy: ProxyFactory, router: str
) -> None:
    _, _, backends = await pd_pair(fake)
    settings = kv(backends) if router == "kv" else quick_settings(backends)
    assert settings.debug_headers is False  # the default
    running = await proxy(settings)
    async with running.client() as client:
        resp = await client.post("/v1/completions", json=BODY, headers=DEBUG)
    assert resp.status_code == 200
    assert "x-pdproxy-route" not in resp.headers
    assert "server-timing" in resp.headers  # the rest of the debugging aids stay


async def test_request_refused_before_routing_carries_no_explanation(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    _, _, backends = await pd_pair(fake)
    running = await proxy(kv(backends, debug_headers=True))
    async with running.client() as client:
        resp = await client.post("/v1/completions", content=b"{not json", headers=DEBUG)
    assert resp.status_code == 400
    assert "x-pdproxy-route" not in resp.headers
