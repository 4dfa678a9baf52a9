"""A consumer that fails the leg carrying the producer's KV prefills alone (one more leg).

vLLM fails a request whose KV load failed with 500 (its default ``kv_load_failure_policy`` is
``fail``): a NIXL handshake that timed out, a producer gone after its answer, expired blocks.
The producer's KV cannot be had again, so the proxy sends that consumer the client's request
without ``kv_transfer_params`` once; only after a server error the consumer answered, never
after a timeout, a connection failure, 503 or 429.
"""

from __future__ import annotations

import pytest

from pdproxy.routing.base import RequestOutcome
from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RecordingRouter,
    backend_entry,
    eventually,
    quick_settings,
)


@pytest.mark.parametrize("stream", [False, True])
async def test_consumer_failing_the_kv_leg_prefills_alone(
    fake: FakeFactory, proxy: ProxyFactory, stream: bool
) -> None:
    p = await fake("P")
    d = await fake("D", fail_status=500, fail_count=1)
    router = RecordingRouter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")]),
        router,
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "stream": stream})
        metrics = (await c.get("/metrics")).text
    assert r.status_code == 200, r.text
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"
    assert r.headers["x-pdproxy-retries"] == "1"
    assert ("data: [DONE]" in r.text) is stream
    legs = d.consumer_legs()
    assert len(legs) == 2
    # Each leg has its own engine request id, also on the same consumer.
    assert [leg.headers["x-request-id"][-3:] for leg in legs] == ["-d0", "-d1"]
    assert "kv_transfer_params" in legs[0].json()
    kv_id = p.completions()[0].json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    assert "kv_transfer_params" not in legs[1].json()  # the second leg prefills
    assert legs[1].json()["prompt"] == "x"
    # Nobody fetches the supply any more: released once, not again when the request ends.
    await eventually(lambda: p.releases == [kv_id])
    router.assert_each_finished_once()
    assert router.finished_calls[0][1] == RequestOutcome(
        producer="P", consumer="D", ok=True, cached_tokens=None
    )
    assert "pdproxy_fallbacks_total 1.0" in metrics
    assert p.releases == [kv_id]


async def test_the_consumer_that_answered_last_prefills(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d1 = await fake("D1", fail_status=500, fail_count=1)
    d2 = await fake("D2", fail_status=500, fail_count=1)
    px = await proxy(
        quick_settings(
            [
                backend_entry(p, "producer", "p2p"),
                backend_entry(d1, "consumer", "p2p"),
                backend_entry(d2, "consumer", "p2p"),
            ]
        ),
        RecordingRouter(),
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 200, r.text
    assert r.headers["x-pdproxy-retries"] == "2"
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"
    assert len(d1.consumer_legs()) == 1
    first, second = d2.consumer_legs()
    assert "kv_transfer_params" in first.json()
    assert "kv_transfer_params" not in second.json()
    ids = [leg.headers["x-request-id"][-3:] for leg in (*d1.consumer_legs(), first, second)]
    assert ids == ["-d0", "-d1", "-d2"]


_ONE_LEG_ONLY = {
    # case: (producer behaviour, consumer behaviour, settings, status to the client)
    "503: busy": ({}, {"fail_status": 503, "fail_count": 1}, {}, 502),
    "429: busy": ({}, {"fail_status": 429, "fail_count": 1}, {}, 502),
    "first byte timed out": (
        {},
        {"first_chunk_delay_s": 5.0},
        {"timeouts": {"consumer_first_byte_s": 0.3}},
        504,
    ),
    "fallback off": (
        {},
        {"fail_status": 500, "fail_count": 1},
        {"retries": {"fallback_to_consumer": False, "backoff_base_s": 0.001}},
        502,
    ),
    # Producers failed, so the consumer leg carried no KV: its 500 ends the request.
    "leg without KV": ({"fail_status": 500}, {"fail_status": 500, "fail_count": 1}, {}, 502),
}


@pytest.mark.parametrize("case", list(_ONE_LEG_ONLY))
async def test_no_second_leg(fake: FakeFactory, proxy: ProxyFactory, case: str) -> None:
    producer, consumer, settings, status = _ONE_LEG_ONLY[case]
    p = await fake("P", **producer)
    d = await fake("D", **consumer)
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")], **settings
        ),
        RecordingRouter(),
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == status
    # Only the producers' own failure marks it (the consumer served without their KV).
    assert r.headers.get("x-pdproxy-fallback") == ("consumer-only" if producer else None)
    assert len(d.consumer_legs()) == 1
