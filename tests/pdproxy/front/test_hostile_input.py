"""Hostile clients against an in-process proxy: each test plays the attacker of one rule.

Rules: ``vllm_xargs.kv_transfer_params`` is gated like the top-level key; nested JSON is a 400;
trace headers are validated and capped; upstream failures reach clients without backend names
or addresses; ``/v1/models`` needs the key and is cached; a slow body is cut at its deadline;
a client's reused ``X-Request-Id`` never reaches an engine; producer answers naming another KV
address are refused; producer legs drop answer-shaping fields.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from loadtest.fake_backend import FakeBackend
from pdproxy.request.legs import PRODUCER_REMOVED_FIELDS
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RecordingRouter,
    backend_entry,
    eventually,
    quick_settings,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_vllm_xargs_kv_transfer_params_refused_unless_trusted(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer"), backend_entry(d, "consumer")],
            api_keys=[{"key": "user"}, {"key": "orchestrator", "trusted": True}],
        )
    )
    evil = {"remote_host": "evil.example", "remote_port": 1, "do_remote_prefill": True}
    body = {"prompt": "x", "vllm_xargs": {"kv_transfer_params": evil}}
    async with px.client() as c:
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer user"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "kv_transfer_params_not_allowed"
        assert p.received == [] and d.received == []
        r = await c.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer orchestrator"}
        )
    assert r.status_code == 200
    assert p.received == []  # a trusted caller's own params: passed through, no producer leg
    assert d.completions()[0].json()["vllm_xargs"] == {"kv_transfer_params": evil}


@pytest.mark.parametrize("depth", [300, 5000, 100_000])
async def test_deeply_nested_json_is_a_400(
    fake: FakeFactory, proxy: ProxyFactory, depth: int
) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]))
    nested = b"[" * depth + b"1234567890123456789012" + b"]" * depth
    async with px.client() as c:
        for raw in (
            b'{"prompt": "x", "extra": ' + nested + b"}",  # a 22-digit integer: stdlib path
            b'{"prompt": "x", "extra": ' + b"[" * depth + b"1" + b"]" * depth + b"}",
        ):
            r = await c.post("/v1/completions", content=raw)
            if depth <= 500:  # deep but readable and writable: served, not refused
                assert r.status_code == 200, (depth, r.status_code, r.text[:200])
                continue
            assert r.status_code == 400, (depth, r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "invalid_request_error"
    if depth > 500:
        assert d.received == []
    assert px.state.admission.active == 0


async def test_trace_headers_validated_and_capped(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(d, "consumer")]))
    cases = [
        ({"traceparent": TRACEPARENT, "tracestate": "a=1", "baggage": "k=v"}, True, True, True),
        ({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01", "tracestate": "a=1"},
         False, False, False),  # all-zero trace id: invalid, and tracestate goes with it
        ({"traceparent": TRACEPARENT + "x" * 200}, False, False, False),
        ({"traceparent": TRACEPARENT, "tracestate": ",".join(f"k{i}=v" for i in range(40))},
         True, False, False),  # more than 32 members
        ({"baggage": "k=" + "v" * 9000}, False, False, False),  # over 8192 bytes
        ({"baggage": "k=v w"}, False, False, False),  # a space inside a value
    ]  # fmt: skip
    async with px.client() as c:
        for headers, parent, state, baggage in cases:
            before = len(d.completions())
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 200
            leg = d.completions()[before]
            assert ("traceparent" in leg.headers) is parent, headers
            assert ("tracestate" in leg.headers) is state, headers
            assert ("baggage" in leg.headers) is baggage, headers


async def test_upstream_errors_name_no_backend(fake: FakeFactory, proxy: ProxyFactory) -> None:
    p = await fake("secret-producer", fail_status=500)
    d = await fake("secret-consumer", fail_status=503)
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer"), backend_entry(d, "consumer")],
            retries={"fallback_to_consumer": False, "backoff_base_s": 0.001},
        )
    )
    async with px.client() as c:
        failed = await c.post("/v1/completions", json={"prompt": "x"})
        px.state.registry.get("secret-consumer").draining = True  # type: ignore[union-attr]
        unavailable = await c.post("/v1/completions", json={"prompt": "x"})
        metrics = (await c.get("/metrics")).text
    assert failed.status_code == 502 and unavailable.status_code == 503
    for r in (failed, unavailable):
        text = r.text
        assert "secret" not in text and "127.0.0.1" not in text and str(p.port) not in text
        assert set(r.json()["error"]) == {"message", "type", "code"}
    # The details are in the metrics instead.
    assert 'pdproxy_upstream_failures_total{backend="secret-producer",kind="status_5xx"}' in metrics


async def test_models_needs_the_key_and_is_cached(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    px = await proxy(
        quick_settings([backend_entry(d, "consumer")], api_keys=[{"key": "k"}], models_cache_s=60)
    )
    async with px.client() as c:
        assert (await c.get("/v1/models")).status_code == 401
        assert (
            await c.get("/v1/models", headers={"Authorization": "Bearer no"})
        ).status_code == 401
        key = {"Authorization": "Bearer k"}
        answers = await asyncio.gather(*(c.get("/v1/models", headers=key) for _ in range(20)))
    assert {r.status_code for r in answers} == {200}
    assert answers[0].json()["data"][0]["id"] == "fake-model"
    fanouts = [r for r in d.received if r.path == "/v1/models"]
    assert len(fanouts) == 1  # 20 callers, one fan-out: the rest from the cache


async def test_slow_body_is_cut_at_its_deadline(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [backend_entry(d, "consumer")],
            admission={"body_read_timeout_s": 0.5, "max_concurrent": 2, "queue_size": 0},
        )
    )
    url = urlsplit(px.url)
    assert url.hostname is not None and url.port is not None
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "'
    )
    await writer.drain()
    # Generous bound (product promise: cut at 0.5 s; the machine may be loaded).
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"request_timeout" in answer
    await eventually(lambda: px.state.admission.active == 0)
    assert d.received == []


async def test_reused_client_request_id_never_reaches_engines(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]))
    async with px.client() as c:
        answers = [
            await c.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "same"})
            for _ in range(3)
        ]
    assert [r.headers["x-request-id"] for r in answers] == ["same"] * 3  # echoed back
    legs = [r.headers["x-request-id"] for r in p.completions() + d.completions()]
    assert len(set(legs)) == 6 and not any("same" in leg for leg in legs)
    engine_ids = {r.json()["kv_transfer_params"]["remote_request_id"] for r in d.completions()}
    assert len(engine_ids) == 3  # each producer supply named after its own leg


async def _p2p_request_with_kv_address(
    fake: FakeFactory, proxy: ProxyFactory, kv_address: str
) -> tuple[FakeBackend, FakeBackend, httpx.Response, str]:
    """One P2P request through a producer whose answers name 127.0.0.1:7123, configured with
    ``kv_address``; returns the producer, the consumer, the answer and the proxy's metrics."""
    p = await fake("P", p2p_port=7123)
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [
                backend_entry(p, "producer", "p2p", kv_address=kv_address),
                backend_entry(d, "consumer", "p2p"),
            ]
        )
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        metrics = (await c.get("/metrics")).text
    return p, d, r, metrics


async def test_producer_naming_another_kv_address_is_refused(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p, d, r, metrics = await _p2p_request_with_kv_address(fake, proxy, "127.0.0.1:7999")
    assert r.status_code == 200
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"  # the consumer recomputed
    [leg] = d.completions()
    assert "kv_transfer_params" not in leg.json()  # never sent to the address named
    kv_id = p.completions()[0].json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    await eventually(lambda: p.releases == [kv_id])
    assert 'pdproxy_kv_address_mismatches_total{backend="P"} 1.0' in metrics


async def test_producer_at_its_configured_kv_address_is_used(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    _, d, r, metrics = await _p2p_request_with_kv_address(fake, proxy, "127.0.0.1:7123")
    assert r.status_code == 200 and "x-pdproxy-fallback" not in r.headers
    prefiller = d.completions()[0].json()["kv_transfer_params"]["remote_prefiller"]
    assert (prefiller["remote_host"], prefiller["remote_port"]) == ("127.0.0.1", 7123)
    assert 'pdproxy_kv_address_mismatches_total{backend="P"}' not in metrics


async def test_producer_legs_drop_answer_shaping_fields(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]))
    body = {"prompt": "x", "echo": True, "logprobs": 5, "n": 3, "best_of": 4, "max_tokens": 9}
    async with px.client() as c:
        assert (await c.post("/v1/completions", json=body)).status_code == 200
    leg = p.completions()[0].json()
    assert not {"echo", "logprobs", "n", "best_of"} & set(leg)
    assert {"echo", "logprobs", "n", "best_of"} <= set(PRODUCER_REMOVED_FIELDS)
    assert d.completions()[0].json()["n"] == 3  # the consumer answers as the client asked


async def test_router_sees_only_candidates_of_one_dialect(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p_nixl = await fake("Pn")
    p_p2p = await fake("Pp")
    d = await fake("D")
    router = RecordingRouter()
    px = await proxy(
        quick_settings(
            [
                backend_entry(p_nixl, "producer", "nixl"),
                backend_entry(p_p2p, "producer", "p2p"),
                backend_entry(d, "consumer", "p2p"),
            ]
        ),
        router,
    )
    async with px.client() as c:
        for _ in range(3):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    for decision in router.decisions:
        assert [b.name for b in decision.producers] == ["Pp"]
    assert p_nixl.received == []
    router.assert_each_finished_once()


async def test_request_specific_500s_do_not_open_breakers(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    """Every engine fails the same poisoned request: no backend is to blame."""
    p = await fake("P", fail_status=500)
    d = await fake("D", fail_status=500)
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer"), backend_entry(d, "consumer")],
            breaker={"failure_threshold": 2, "open_s": 30},
        )
    )
    async with px.client() as c:
        for _ in range(6):
            r = await c.post("/v1/completions", json={"prompt": "poison"})
            assert r.status_code == 502
        # Each failure asks the health check, which finds both healthy.
        await eventually(lambda: 'backend="D",result="healthy"' in _text(px.state.metrics.registry))
        metrics = (await c.get("/metrics")).text
    assert 'pdproxy_backend_breaker_state{backend="P"} 0.0' in metrics
    assert 'pdproxy_backend_breaker_state{backend="D"} 0.0' in metrics


async def test_backend_failing_what_others_serve_opens_its_breaker(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    bad = await fake("Pbad", fail_status=503, fail_producer_only=True)
    good = await fake("Pgood")
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [
                backend_entry(bad, "producer"),
                backend_entry(good, "producer"),
                backend_entry(d, "consumer"),
            ],
            breaker={"failure_threshold": 2, "open_s": 30},
        )
    )
    async with px.client() as c:
        for _ in range(6):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
        metrics = (await c.get("/metrics")).text
    assert 'pdproxy_backend_breaker_state{backend="Pbad"} 2.0' in metrics
    assert 'pdproxy_backend_breaker_state{backend="Pgood"} 0.0' in metrics


async def test_failure_everywhere_with_a_failing_health_check_opens_the_breaker(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d = await fake("D", fail_status=503, health_status=503)
    px = await proxy(
        quick_settings([backend_entry(d, "consumer")], breaker={"failure_threshold": 2})
    )
    async with px.client() as c:
        for i in range(1, 3):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 502
            await _confirmed_failures(px.state.metrics.registry, "D", i)
        metrics = (await c.get("/metrics")).text
    assert 'pdproxy_backend_breaker_state{backend="D"} 2.0' in metrics


async def _confirmed_failures(registry: CollectorRegistry, backend: str, n: int) -> None:
    line = f'pdproxy_breaker_confirmations_total{{backend="{backend}",result="failed"}} {n}.0'
    await eventually(lambda: line in _text(registry))


def _text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_orjson_dumps_nesting_limit_is_what_the_body_guard_assumes() -> None:
    deep: list[object] = []
    node = deep
    for _ in range(300):
        child: list[object] = []
        node.append(child)
        node = child
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(deep)
