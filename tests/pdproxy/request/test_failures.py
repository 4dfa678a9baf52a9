"""Failure handling: retries, failover, fallback, timeouts, mid-stream breaks, finished once."""

from __future__ import annotations

import orjson

from pdproxy.routing.base import RequestOutcome
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RecordingRouter,
    backend_entry,
    eventually,
    quick_settings,
)


async def test_producer_failure_retries_on_another_producer(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p1 = await fake("P1", fail_status=503)
    p2 = await fake("P2")
    d = await fake("D")
    router = RecordingRouter()
    px = await proxy(
        quick_settings(
            [
                backend_entry(p1, "producer"),
                backend_entry(p2, "producer"),
                backend_entry(d, "consumer"),
            ]
        ),
        router,
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200
    assert r.headers["x-pdproxy-retries"] == "1"
    assert "x-pdproxy-fallback" not in r.headers
    assert len(p1.completions()) == 1 and len(p2.completions()) == 1
    assert d.consumer_legs()[0].json()["kv_transfer_params"]["remote_engine_id"] == "engine-P2"
    router.assert_each_finished_once()
    outcome = router.finished_calls[0][1]
    assert outcome == RequestOutcome(producer="P2", consumer="D", ok=True, cached_tokens=None)


async def test_all_producers_fail_then_consumer_serves_alone(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P", fail_status=500)
    d = await fake("D")
    router = RecordingRouter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")]),
        router,
    )
    raw = b'{"prompt": "x", "top_p": 0.9}'
    async with px.client() as c:
        r = await c.post("/v1/completions", content=raw)
        metrics = (await c.get("/metrics")).text
    assert r.status_code == 200
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"
    [leg] = d.completions()
    assert leg.raw == raw  # the client's bytes, no kv_transfer_params
    assert "pdproxy_fallbacks_total 1.0" in metrics
    # The failed producer might hold a supply: it is told to release it.
    kv_id = p.completions()[0].json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    assert p.releases == [kv_id]
    router.assert_each_finished_once()
    assert router.finished_calls[0][1] == RequestOutcome(
        producer=None, consumer="D", ok=True, cached_tokens=None
    )


async def test_fallback_disabled_gives_openai_shaped_502(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P", fail_status=500)
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer"), backend_entry(d, "consumer")],
            retries={"fallback_to_consumer": False, "backoff_base_s": 0.001},
        )
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "upstream_error"
    assert d.received == []


async def test_producer_4xx_is_relayed_not_retried(fake: FakeFactory, proxy: ProxyFactory) -> None:
    p1 = await fake("P1", fail_status=400)
    p2 = await fake("P2")
    d = await fake("D")
    px = await proxy(
        quick_settings(
            [
                backend_entry(p1, "producer"),
                backend_entry(p2, "producer"),
                backend_entry(d, "consumer"),
            ]
        )
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400
    assert p2.received == [] and d.received == []


async def test_producer_down_and_timeout_fall_back(fake: FakeFactory, proxy: ProxyFactory) -> None:
    slow = await fake("Pslow", producer_delay_s=5)
    d = await fake("D")
    dead_url = "http://127.0.0.1:9"  # discard port: connection refused
    px = await proxy(
        quick_settings(
            [
                {"name": "Pdead", "url": dead_url, "role": "producer"},
                backend_entry(slow, "producer"),
                backend_entry(d, "consumer"),
            ],
            timeouts={"producer_total_s": 0.3, "connect_s": 0.5},
        )
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"
    assert r.headers["x-pdproxy-retries"] == "1"
    assert len(slow.completions()) == 1
    assert "kv_transfer_params" not in d.completions()[0].json()


async def test_bad_producer_answer_counts_as_failure(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P", bad_producer_answer=True)
    d = await fake("D")
    px = await proxy(quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]))
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"


async def test_consumer_failure_before_first_byte_retries_elsewhere(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d1 = await fake("D1", fail_status=502)
    d2 = await fake("D2", cached_tokens=12)
    router = RecordingRouter()
    px = await proxy(
        quick_settings(
            [
                backend_entry(p, "producer", "p2p"),
                backend_entry(d1, "consumer", "p2p"),
                backend_entry(d2, "consumer", "p2p"),
            ]
        ),
        router,
    )
    async with px.client() as c:
        r = await c.post(
            "/v1/completions",
            json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        )
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")
    assert r.headers["x-pdproxy-retries"] == "1"
    # Both consumers got the same supply id: any consumer can pull it.
    kvp1 = d1.completions()[0].json()["kv_transfer_params"]
    kvp2 = d2.completions()[0].json()["kv_transfer_params"]
    assert kvp1 == kvp2
    assert p.releases == []
    router.assert_each_finished_once()
    assert router.finished_calls[0][1] == RequestOutcome(
        producer="P", consumer="D2", ok=True, cached_tokens=12
    )


async def test_all_consumers_fail_is_502_and_supply_released(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D", fail_status=503)
    router = RecordingRouter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")]),
        router,
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 502
    assert set(r.json()["error"]) == {"message", "type", "code"}
    kv_id = p.completions()[0].json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    await eventually(lambda: p.releases == [kv_id])
    router.assert_each_finished_once()
    assert router.finished_calls[0][1].ok is False


async def test_stream_cut_after_first_byte_ends_with_error_event(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D", chunks=6, cut_after_chunks=2, chunk_delay_s=0.01)
    router = RecordingRouter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")]),
        router,
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) == 3
    last = orjson.loads(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == "consumer_stream_broken"
    assert set(last["error"]) == {"message", "type", "code"}
    await eventually(lambda: len(p.releases) == 1)
    router.assert_each_finished_once()
    assert router.finished_calls[0][1].ok is False


async def test_consumer_idle_timeout_ends_stream(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D", chunks=3, chunk_delay_s=2.0)
    px = await proxy(
        quick_settings([backend_entry(d, "consumer")], timeouts={"consumer_idle_s": 0.2})
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) == 2
    assert orjson.loads(events[-1].removeprefix("data: "))["error"]["code"] == "consumer_idle"
    await eventually(lambda: d.aborts == 1)


async def test_consumer_first_byte_timeout_tries_next(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d1 = await fake("D1", first_chunk_delay_s=5)
    d2 = await fake("D2")
    px = await proxy(
        quick_settings(
            [backend_entry(d1, "consumer"), backend_entry(d2, "consumer")],
            timeouts={"consumer_first_byte_s": 0.3},
        )
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200
    assert len(d2.completions()) == 1
    await eventually(lambda: d1.aborts == 1)


async def test_no_consumer_is_503(fake: FakeFactory, proxy: ProxyFactory) -> None:
    p = await fake("P")
    px = await proxy(quick_settings([backend_entry(p, "producer")]))
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert (await c.get("/ready")).status_code == 503
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_backend_available"
