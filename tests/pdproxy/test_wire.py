"""Wire tests: what each leg carries, seen by fake engines that are real HTTP servers."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from loadtest.fake_backend import nixl_producer_answer
from pdproxy.request.legs import PRODUCER_REMOVED_FIELDS
from pdproxy.routing.base import RequestOutcome
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RecordingRouter,
    backend_entry,
    quick_settings,
)

NIXL_PRODUCER = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"

CASES: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/completions",
        {
            "model": "fake-model",
            "prompt": "the quick brown fox",
            "max_tokens": 8,
            "min_tokens": 2,
            "temperature": 0.0,
            "top_p": 0.9,
            "repetition_penalty": 1.1,
            "seed": 7,
            "stop": ["\n\n"],
            "cache_salt": "salt-1",
            "custom_unknown_field": "keep-me",
        },
    ),
    (
        "/v1/completions",
        {
            "model": "fake-model",
            "prompt": "stream me",
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 6,
            "min_tokens": 2,
            "min_completion_tokens": 2,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ("/v1/completions", {"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": 3}),
]


def expected_producer_leg(client: dict[str, Any], kvp: dict[str, Any]) -> dict[str, Any]:
    leg = {k: v for k, v in client.items() if k not in PRODUCER_REMOVED_FIELDS}
    leg.update(stream=False, max_tokens=1, kv_transfer_params=kvp)
    if "max_completion_tokens" in client:
        leg["max_completion_tokens"] = 1
    return leg


@pytest.mark.parametrize(("path", "client"), CASES)
async def test_nixl_legs_follow_the_rules(
    fake: FakeFactory, proxy: ProxyFactory, path: str, client: dict[str, Any]
) -> None:
    p = await fake("P")
    d = await fake("D", cached_tokens=5)
    px = await proxy(
        quick_settings(
            [
                backend_entry(p, "producer", api_key="p-key"),
                backend_entry(d, "consumer"),
            ],
            api_keys=[{"key": "client-secret"}],
        )
    )
    headers = {
        "X-Request-Id": "client-rid-1",
        "Authorization": "Bearer client-secret",
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=1",
        "X-Custom": "not-forwarded",
    }
    async with px.client() as c:
        r = await c.post(path, content=orjson.dumps(client), headers=headers)
    assert r.status_code == 200, r.text

    [prod] = p.completions()
    [cons] = d.completions()
    assert prod.path == cons.path == path
    # Both legs carry the key's tenant salt (derived, never the client's own: issue 30).
    salt = prod.json()["cache_salt"]
    assert salt == cons.json()["cache_salt"] != client.get("cache_salt")
    assert len(salt) == 64
    client = {**client, "cache_salt": salt}
    assert prod.json() == expected_producer_leg(client, NIXL_PRODUCER)
    # The consumer gets the producer's returned object verbatim.
    answered = nixl_producer_answer("P", prod.headers["x-request-id"], "127.0.0.1")
    assert cons.json() == {**client, "kv_transfer_params": answered}
    # Floats are written as the client wrote them (no f32 rounding).
    if "top_p" in client:
        assert b'"top_p":0.9' in prod.raw and b'"top_p":0.9' in cons.raw

    # Each leg carries its own id, never the client's (issue 15: a reused client id must not
    # collide on the engines); the client still gets its own id back.
    assert prod.headers["x-request-id"] != cons.headers["x-request-id"]
    for leg in (prod, cons):
        assert "client-rid-1" not in leg.headers["x-request-id"]
        assert leg.headers["traceparent"] == TRACEPARENT
        assert leg.headers["tracestate"] == "vendor=1"
        assert "x-custom" not in leg.headers
    assert prod.headers["authorization"] == "Bearer p-key"
    assert "authorization" not in cons.headers  # no key configured: no header, never "None"

    assert r.headers["x-request-id"] == "client-rid-1"
    assert "producer;dur=" in r.headers["server-timing"]
    assert "consumer_fb;dur=" in r.headers["server-timing"]
    if client.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert r.headers["content-type"] == "application/json"
        assert r.json()["object"] in ("text_completion", "chat.completion")


async def test_p2p_legs(fake: FakeFactory, proxy: ProxyFactory) -> None:
    p = await fake("P", p2p_port=7123)
    d = await fake("D")
    px = await proxy(
        quick_settings([backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")])
    )
    client = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}
    async with px.client() as c:
        r = await c.post("/v1/completions", json=client)
    assert r.status_code == 200
    [prod] = p.completions()
    [cons] = d.completions()
    kv_id = prod.json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    assert len(kv_id) == 32
    assert prod.json() == expected_producer_leg(
        client, {"remote_decoder": {"kv_request_id": kv_id}}
    )
    assert cons.json() == {
        **client,
        "kv_transfer_params": {
            "remote_prefiller": {
                "kv_request_id": kv_id,
                "remote_host": "127.0.0.1",
                "remote_port": 7123,
            }
        },
    }
    assert p.releases == []  # the consumer completed: nothing to release


async def test_each_request_gets_a_fresh_kv_request_id(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(
        quick_settings([backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")])
    )
    async with px.client() as c:
        for _ in range(3):
            assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    ids = {
        r.json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"] for r in p.completions()
    }
    assert len(ids) == 3


async def test_none_dialect_is_one_leg_with_the_raw_body(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    a = await fake("A")
    px = await proxy(quick_settings([backend_entry(a, "both", "none")]))
    raw = b'{"model": "m",   "prompt": "x", "top_p": 0.10000000000000001}'
    async with px.client() as c:
        r = await c.post("/v1/completions", content=raw)
    assert r.status_code == 200
    [leg] = a.completions()
    assert leg.raw == raw  # byte for byte, whitespace included


async def test_insane_request_id_is_replaced_and_echoed(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]))
    async with px.client() as c:
        r = await c.post(
            "/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "bad id\twith spaces"}
        )
    rid = r.headers["x-request-id"]
    assert rid != "bad id\twith spaces" and len(rid) == 32
    # Legs are named after the proxy's id: one per leg, so the logs tie them together.
    assert p.completions()[0].headers["x-request-id"] == f"{rid}-p0"
    assert d.completions()[0].headers["x-request-id"] == f"{rid}-d0"


async def test_client_kv_transfer_params_refused_unless_trusted(
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
    body = {"prompt": "x", "kv_transfer_params": {"remote_host": "evil.example", "remote_port": 1}}
    async with px.client() as c:
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer user"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "kv_transfer_params_not_allowed"
        assert "route;dur=" in r.headers["server-timing"]
        assert len(r.headers["x-request-id"]) == 32
        assert set(r.json()["error"]) == {"message", "type", "code"}
        assert p.received == [] and d.received == []

        r = await c.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer orchestrator"}
        )
        assert r.status_code == 200
    assert p.completions() == []  # trusted params: the caller orchestrates, one leg
    assert d.completions()[0].json() == body
    assert "authorization" not in d.completions()[0].headers


async def test_client_auth(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(d, "consumer")], api_keys=[{"key": "k1"}]))
    async with px.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k1"}):
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post(
            "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k1"}
        )
        assert r.status_code == 200
    assert len(d.completions()) == 1


async def test_body_limit_is_413_while_reading(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    px = await proxy(
        quick_settings([backend_entry(d, "consumer")], admission={"max_body_bytes": 1000})
    )

    async def chunks() -> Any:  # no content-length: the limit must hold while streaming
        for _ in range(10):
            yield b" " * 200

    async with px.client() as c:
        r = await c.post("/v1/completions", content=chunks())
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        r = await c.post("/v1/completions", content=b'{"prompt":"' + b"x" * 2000 + b'"}')
        assert r.status_code == 413
        r = await c.post("/v1/completions", content=b"[1]")
        assert r.status_code == 400
    assert d.received == []


async def test_consumer_only_mode_and_models_health_ready_metrics(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(d, "consumer")]))
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 2})
        assert r.status_code == 200
        assert (await c.get("/health")).json() == {"status": "ok"}
        assert (await c.get("/ready")).status_code == 200
        models = (await c.get("/v1/models")).json()
        assert models == {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
        metrics = (await c.get("/metrics")).text
    assert 'pdproxy_requests_total{dialect="nixl",route="chat",status="200"} 1.0' in metrics
    assert 'pdproxy_backend_in_flight{backend="D"} 0.0' in metrics
    assert "pdproxy_queue_depth 0.0" in metrics
    assert d.consumer_legs()[0].json() == {"messages": [], "max_tokens": 2}


async def test_consumer_status_and_error_body_are_relayed(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d = await fake("D", fail_status=400)
    px = await proxy(quick_settings([backend_entry(d, "consumer")]))
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400
    assert len(d.completions()) == 1  # 4xx is the client's problem: not retried


async def test_unknown_routes_and_methods_are_openai_shaped(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(d, "consumer")]))
    async with px.client() as c:
        r404 = await c.get("/v1/nothing")
        r405 = await c.get("/v1/completions")
    assert r404.status_code == 404 and r404.json()["error"]["code"] == "not_found"
    assert r405.status_code == 405 and r405.json()["error"]["code"] == "method_not_allowed"
    assert set(r405.json()["error"]) == {"message", "type", "code"}


async def test_non_stream_cached_tokens_reach_the_router(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D", cached_tokens=48)
    router = RecordingRouter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]), router
    )
    async with px.client() as c:
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    router.assert_each_finished_once()
    assert router.finished_calls[0][1] == RequestOutcome(
        producer="P", consumer="D", ok=True, cached_tokens=48
    )
