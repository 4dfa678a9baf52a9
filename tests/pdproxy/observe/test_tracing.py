"""OpenTelemetry tracing: the spans of a proxied request, and a client's trace through both legs.

Real proxy (uvicorn) and fake engines on loopback; spans go to the SDK's in-memory exporter.
The OTLP export itself is in ``test_tracing_export.py``; the settings in
``test_tracing_settings.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdproxy.observe.trace_context import TraceParent
from tests.pdproxy.conftest import FakeFactory, ProxyFactory, backend_entry, quick_settings

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def finished_spans(exporter: InMemorySpanExporter, count: int) -> Sequence[ReadableSpan]:
    """The spans once ``count`` have ended (the request's spans end just after its answer is
    sent, so a client can see the answer a moment before)."""
    for _ in range(500):
        spans = exporter.get_finished_spans()
        if len(spans) >= count:
            return spans
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(exporter.get_finished_spans())} spans ended, wanted {count}")


def by_name(spans: Sequence[ReadableSpan]) -> dict[str, ReadableSpan]:
    out = {span.name: span for span in spans}
    assert len(out) == len(spans), [s.name for s in spans]
    return out


def span_hex(span: ReadableSpan) -> tuple[str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def parent_hex(span: ReadableSpan) -> str:
    assert span.parent is not None
    return f"{span.parent.span_id:016x}"


@pytest.mark.parametrize("stream", [False, True])
async def test_request_spans_continue_the_clients_trace(
    fake: FakeFactory, proxy: ProxyFactory, stream: bool
) -> None:
    p = await fake("P")
    d = await fake("D", cached_tokens=5)
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]),
        span_exporter=exporter,
    )
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "baggage": "k=v"}
    body = {**CHAT, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", content=orjson.dumps(body), headers=headers)
    assert r.status_code == 200, r.text

    spans = by_name(await finished_spans(exporter, 4))
    assert set(spans) == {"POST /v1/chat/completions", "route", "producer leg", "consumer leg"}
    root = spans["POST /v1/chat/completions"]
    assert root.kind is SpanKind.SERVER
    assert root.parent is not None and root.parent.is_remote
    assert parent_hex(root) == CLIENT_SPAN
    trace_id, root_id = span_hex(root)
    assert trace_id == CLIENT_TRACE
    for name in ("route", "producer leg", "consumer leg"):
        assert span_hex(spans[name])[0] == CLIENT_TRACE
        assert parent_hex(spans[name]) == root_id, name
    assert spans["producer leg"].kind is spans["consumer leg"].kind is SpanKind.CLIENT

    assert root.attributes is not None
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["pdproxy.outcome"] == "ok"
    assert root.attributes["pdproxy.producer"] == "P"
    assert root.attributes["pdproxy.consumer"] == "D"
    assert root.attributes["pdproxy.cached_tokens"] == 5
    assert root.attributes["pdproxy.retries"] == 0
    assert root.attributes["pdproxy.dialect"] == "nixl"
    assert root.attributes["pdproxy.request_id"] == r.headers["x-request-id"]
    route = spans["route"].attributes
    assert route is not None
    assert route["pdproxy.route.producers"] == ("P",)
    assert route["pdproxy.route.consumers"] == ("D",)
    producer = spans["producer leg"].attributes
    assert producer is not None
    assert producer["pdproxy.fleet.backends"] == ("P",)
    assert producer["pdproxy.backend"] == "P"
    assert producer["pdproxy.outcome"] == "ok"
    consumer = spans["consumer leg"].attributes
    assert consumer is not None
    assert consumer["pdproxy.backend"] == "D"
    assert consumer["pdproxy.cached_tokens"] == 5
    assert consumer["pdproxy.outcome"] == "ok"
    assert root.resource.attributes["service.name"] == "pdproxy"

    # Each engine leg is a child of its own leg span, in the client's trace; the client's
    # tracestate and baggage go along unchanged.
    [prod] = p.completions()
    [cons] = d.completions()
    for leg, span in ((prod, spans["producer leg"]), (cons, spans["consumer leg"])):
        sent = TraceParent.parse(leg.headers["traceparent"])
        assert sent is not None
        assert sent.trace_id == CLIENT_TRACE
        assert sent.parent_id == span_hex(span)[1]
        assert sent.sampled
        assert leg.headers["tracestate"] == "vendor=1"
        assert leg.headers["baggage"] == "k=v"


async def test_no_client_trace_starts_a_new_one_that_reaches_both_legs(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    p = await fake("P")
    d = await fake("D")
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]),
        span_exporter=exporter,
    )
    bad = "00-" + "0" * 32 + "-b7ad6b7169203331-01"  # invalid: a new trace, not this one
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": bad})
    assert r.status_code == 200
    spans = by_name(await finished_spans(exporter, 4))
    root = spans["POST /v1/chat/completions"]
    assert root.parent is None
    trace_id, _ = span_hex(root)
    [prod] = p.completions()
    [cons] = d.completions()
    for leg in (prod, cons):
        sent = TraceParent.parse(leg.headers["traceparent"])
        assert sent is not None and sent.trace_id == trace_id


async def test_retries_and_fallback_are_on_the_leg_spans(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    bad_p = await fake("P1", fail_status=500)
    worse_p = await fake("P2", fail_status=503)
    d1 = await fake("D1", fail_status=502)
    d2 = await fake("D2", cached_tokens=0)
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings(
            [
                backend_entry(bad_p, "producer"),
                backend_entry(worse_p, "producer"),
                backend_entry(d1, "consumer"),
                backend_entry(d2, "consumer"),
            ],
            router="least_loaded",
        ),
        span_exporter=exporter,
    )
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    assert r.headers["x-pdproxy-fallback"] == "consumer-only"
    spans = by_name(await finished_spans(exporter, 4))
    producer = spans["producer leg"]
    assert producer.attributes is not None
    assert set(producer.attributes["pdproxy.fleet.backends"]) == {"P1", "P2"}  # type: ignore[arg-type]
    assert "pdproxy.backend" not in producer.attributes  # none served
    assert producer.attributes["pdproxy.retries"] == 1
    assert producer.attributes["pdproxy.outcome"] == "failed"
    assert producer.status.status_code is StatusCode.ERROR
    consumer = spans["consumer leg"].attributes
    assert consumer is not None
    assert consumer["pdproxy.retries"] == int(r.headers["x-pdproxy-retries"]) - 1
    assert consumer["pdproxy.backend"] == "D2"
    root = spans["POST /v1/chat/completions"].attributes
    assert root is not None
    assert root["pdproxy.fallback"] is True
    assert root["pdproxy.retries"] == int(r.headers["x-pdproxy-retries"])
    # Every attempt of a leg names that leg's span as its parent.
    legs = [*bad_p.completions(), *worse_p.completions()]
    assert {leg.headers["traceparent"].split("-")[2] for leg in legs} == {span_hex(producer)[1]}


async def test_a_failed_request_ends_every_span_as_an_error(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    d = await fake("D", fail_status=500)
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings([backend_entry(d, "consumer", dialect="none")]), span_exporter=exporter
    )
    async with px.client() as c:
        r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 502
    spans = by_name(await finished_spans(exporter, 3))
    assert set(spans) == {"POST /v1/completions", "route", "consumer leg"}  # no producer leg
    root = spans["POST /v1/completions"]
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes is not None and root.attributes["pdproxy.outcome"] == "error"
    consumer = spans["consumer leg"]
    assert consumer.attributes is not None and consumer.attributes["pdproxy.outcome"] == "error"
    assert consumer.status.status_code is StatusCode.ERROR


async def test_a_refused_request_has_one_span(fake: FakeFactory, proxy: ProxyFactory) -> None:
    d = await fake("D")
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings([backend_entry(d, "consumer")], api_keys=[{"key": "k"}]),
        span_exporter=exporter,
    )
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 401
    [root] = await finished_spans(exporter, 1)
    assert root.attributes is not None
    assert root.attributes["pdproxy.outcome"] == "refused"
    assert root.status.status_code is StatusCode.UNSET  # the client's error, not the proxy's
    assert d.completions() == []


async def test_sampled_out_trace_still_propagates_unsampled(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    """A client's ``sampled=0`` is honoured (parent-based sampler): nothing is exported, and
    the engines are told not to sample either, in the same trace."""
    p = await fake("P")
    d = await fake("D")
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")]),
        span_exporter=exporter,
    )
    other_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    unsampled = f"00-{other_trace}-{CLIENT_SPAN}-00"
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": unsampled})
    assert r.status_code == 200
    for leg in (*p.completions(), *d.completions()):
        sent = TraceParent.parse(leg.headers["traceparent"])
        assert sent is not None
        assert sent.trace_id == other_trace and not sent.sampled
        assert sent.parent_id != CLIENT_SPAN  # the proxy's own (unrecorded) leg span
    # A sampled request after it: its spans are the only ones exported.
    async with px.client() as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    spans = await finished_spans(exporter, 4)
    assert {span_hex(span)[0] for span in spans} == {CLIENT_TRACE}
    assert len(spans) == 4


async def test_a_client_cannot_force_sampling_past_a_ratio_sampler(
    fake: FakeFactory, proxy: ProxyFactory
) -> None:
    """The attacker sends ``sampled=1`` on every request to make the proxy record and export
    them all. With a parent-based sampler (the default) that works, by design of W3C trace
    context; an operator who does not want it sets ``traceidratio``, which ignores the flag."""
    d = await fake("D")
    exporter = InMemorySpanExporter()
    px = await proxy(
        quick_settings(
            [backend_entry(d, "consumer", dialect="none")],
            tracing={"traces_sampler": "traceidratio", "traces_sampler_arg": 0},
        ),
        span_exporter=exporter,
    )
    async with px.client() as c:
        for _ in range(5):
            r = await c.post("/v1/completions", json={"model": "m", "prompt": "x"},
                             headers={"traceparent": TRACEPARENT})  # fmt: skip
            assert r.status_code == 200
    for leg in d.completions():
        sent = TraceParent.parse(leg.headers["traceparent"])
        assert sent is not None and sent.trace_id == CLIENT_TRACE and not sent.sampled
    # Every request's lease has closed (the fake saw all five legs and answered); none
    # recorded a span.
    assert len(d.completions()) == 5
    assert exporter.get_finished_spans() == ()
