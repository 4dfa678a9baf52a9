"""Every way a request can end, through a real in-process proxy: the lease gives back all of it.

Producer (answers, fails) x consumer (answers, fails, cuts its stream) x stream or not. After
each request: no backend counted in flight, the admission slot free, the router told once with
the right verdict, and the producer's supply released exactly when the request did not
succeed (a failed producer attempt's supply is always released).
"""

from __future__ import annotations

import pytest

from tests.pdproxy.conftest import (
    FakeFactory,
    ProxyFactory,
    RecordingRouter,
    backend_entry,
    eventually,
    quick_settings,
)

CASES = [
    (producer, consumer, stream)
    for producer in ("ok", "fail")
    for consumer in ("ok", "fail", "cut")
    for stream in (False, True)
    if not (consumer == "cut" and not stream)
]


@pytest.mark.parametrize(("producer", "consumer", "stream"), CASES)
async def test_request_end_gives_everything_back(
    fake: FakeFactory, proxy: ProxyFactory, producer: str, consumer: str, stream: bool
) -> None:
    p = await fake("P", **({"fail_status": 500} if producer == "fail" else {}))
    behavior = {"fail_status": 503} if consumer == "fail" else {}
    if consumer == "cut":
        behavior = {"chunks": 6, "cut_after_chunks": 2}
    d = await fake("D", **behavior)
    router = RecordingRouter()
    px = await proxy(
        quick_settings(
            [backend_entry(p, "producer", "p2p"), backend_entry(d, "consumer", "p2p")],
            breaker={"failure_threshold": 100},
        ),
        router,
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"prompt": "x", "stream": stream})
        body = r.text
    succeeded = consumer == "ok"
    if consumer == "fail":
        assert r.status_code == 502
    elif consumer == "cut":
        assert r.status_code == 200 and '"error"' in body  # the stream ends with an error event
    else:
        assert r.status_code == 200 and '"error"' not in body
    await eventually(lambda: len(router.finished_calls) == 1)
    router.assert_each_finished_once()
    assert router.finished_calls[0][1].ok is succeeded
    assert [b.in_flight for b in px.state.registry.all()] == [0, 0]
    assert px.state.admission.active == 0
    [leg] = p.completions()
    kv_id = leg.json()["kv_transfer_params"]["remote_decoder"]["kv_request_id"]
    released = producer == "fail" or not succeeded
    await eventually(lambda: p.releases == ([kv_id] if released else []))
