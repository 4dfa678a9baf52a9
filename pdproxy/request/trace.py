"""The spans of one proxied request (imported only when tracing is on: ``pdproxy[otel]``).

One trace per client request, continuing the client's W3C trace when it sent a valid
``traceparent`` (:class:`~pdproxy.observe.trace_context.TraceParent`), else a new one::

    POST /v1/chat/completions   (SERVER: the whole request, until the answer is sent)
    ├── route                   (INTERNAL: the router's decision)
    ├── producer leg            (CLIENT: every producer attempt, until kv_transfer_params)
    └── consumer leg            (CLIENT: every consumer attempt, until the answer is relayed)

Each leg's request carries a ``traceparent`` naming its leg span, so an engine that traces
(vLLM with ``--otlp-traces-endpoint``, the reference worker's request id logs) joins the same
trace; the client's ``tracestate`` and ``baggage`` go along unchanged. Attributes (names under
``pdproxy.``) say which backends were candidates and which served, retries, cached tokens and
the outcome; they are set when the request ends, from the request's
:class:`~pdproxy.request.record.RequestRecord`, so the request path only marks where phases begin
and end.

Spans are not attached to the ambient OpenTelemetry context (no contextvars tokens to leak
across the streamed answer): parents are passed explicitly. The tracer provider is this app's
own, never the process-global one, so two apps in one process keep their settings apart.
Spans are exported from the SDK's batch processor thread; a full queue drops spans, never
delays a request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBasedTraceIdRatio,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.span import TraceState
from opentelemetry.trace.status import Status, StatusCode
from starlette.datastructures import Headers

from pdproxy import __version__
from pdproxy.front.intake import Endpoint
from pdproxy.observe.trace_context import TraceParent, trace_headers
from pdproxy.settings.tracing import OtelSettings

if TYPE_CHECKING:
    from pdproxy.fleet.backends import Backend
    from pdproxy.request.record import RequestRecord
    from pdproxy.routing.base import RouteDecision

log = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499


def _sampler(settings: OtelSettings) -> Sampler:
    rate = 1.0 if settings.traces_sampler_arg is None else settings.traces_sampler_arg
    match settings.traces_sampler:
        case "always_on":
            return ALWAYS_ON
        case "always_off":
            return ALWAYS_OFF
        case "parentbased_always_off":
            return DEFAULT_OFF
        case "traceidratio":
            return TraceIdRatioBased(rate)
        case "parentbased_traceidratio":
            return ParentBasedTraceIdRatio(rate)
    return DEFAULT_ON


def _exporter(settings: OtelSettings) -> SpanExporter:
    if settings.exporter == "console":
        return ConsoleSpanExporter(service_name=settings.service_name)
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(
        endpoint=settings.traces_endpoint(),
        headers=settings.export_headers(),
        timeout=settings.export_timeout_s(),
        compression=Compression(settings.exporter_otlp_compression),
    )


def _outcome(ok: bool, status: int) -> str:
    if ok:
        return "ok"
    if status == CLIENT_CLOSED_STATUS:
        return "client_closed"
    return "refused" if status < 500 else "error"


def _remote_parent(parent: TraceParent, tracestate: str | None) -> Context:
    state = TraceState.from_header([tracestate]) if tracestate else None
    context = SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.parent_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(parent.flags & 0xFF),
        trace_state=state,
    )
    return trace.set_span_in_context(NonRecordingSpan(context))


class RequestTracer:
    """Starts one :class:`RequestTrace` per client request; owns the tracer provider."""

    def __init__(self, provider: TracerProvider) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("pdproxy", __version__)

    @classmethod
    def from_settings(
        cls, settings: OtelSettings, exporter: SpanExporter | None = None
    ) -> RequestTracer:
        provider = TracerProvider(
            resource=Resource(settings.resource()), sampler=_sampler(settings)
        )
        processor: SpanProcessor
        if exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        else:
            processor = BatchSpanProcessor(
                _exporter(settings),
                max_queue_size=settings.bsp_max_queue_size,
                schedule_delay_millis=settings.bsp_schedule_delay,
                max_export_batch_size=settings.bsp_max_export_batch_size,
                export_timeout_millis=settings.bsp_export_timeout,
            )
            log.info(
                "tracing on: %s exporter%s", settings.exporter,
                f" to {settings.traces_endpoint()}" if settings.exporter == "otlp" else "",
            )  # fmt: skip
        provider.add_span_processor(processor)
        return cls(provider)

    def start(self, request_id: str, endpoint: Endpoint, headers: Headers) -> RequestTrace:
        forwarded = trace_headers(headers)
        raw_parent = forwarded.get("traceparent")
        parent = TraceParent.parse(raw_parent) if raw_parent is not None else None
        context = _remote_parent(parent, forwarded.get("tracestate")) if parent else None
        path = endpoint.path
        span = self._tracer.start_span(
            f"POST {path}",
            context=context,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": path,
                "pdproxy.request_id": request_id,
                "pdproxy.route": str(endpoint),  # the plain name, for any exporter
            },
        )
        return RequestTrace(self._tracer, span)

    def shutdown(self) -> None:
        """Flush and stop the exporter (blocking: call it off the event loop)."""
        self._provider.shutdown()


class RequestTrace:
    """The spans of one request. The request path calls :meth:`routing`, :meth:`routed`,
    :meth:`leg` and :meth:`producer_done` as phases go by; the request's lease calls :meth:`end`
    once, with what the request did."""

    __slots__ = (
        "_consumer", "_context", "_producer", "_producer_retries", "_route", "_span", "_tracer",
    )  # fmt: skip

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span
        self._context = trace.set_span_in_context(span)
        self._route: Span | None = None
        self._producer: Span | None = None
        self._consumer: Span | None = None
        self._producer_retries = 0

    @property
    def trace_id(self) -> str:
        return f"{self._span.get_span_context().trace_id:032x}"

    def routing(self) -> None:
        self._route = self._tracer.start_span("route", context=self._context)

    def routed(self, decision: RouteDecision[Backend]) -> None:
        span = self._route
        if span is None:
            return
        span.set_attributes(
            {
                "pdproxy.route.reason": decision.reason,
                "pdproxy.route.producers": [b.name for b in decision.producers],
                "pdproxy.route.consumers": [b.name for b in decision.consumers],
            }
        )
        if decision.predicted_cached_tokens is not None:
            span.set_attribute("pdproxy.route.predicted_cached_tokens",
                               decision.predicted_cached_tokens)  # fmt: skip
        if decision.predicted_producer_cached_tokens is not None:
            span.set_attribute("pdproxy.route.predicted_producer_cached_tokens",
                               decision.predicted_producer_cached_tokens)  # fmt: skip
        if decision.prompt_tokens is not None:
            span.set_attribute("pdproxy.route.prompt_tokens", decision.prompt_tokens)
        span.end()
        self._route = None

    def leg(self, kind: str, candidates: Sequence[Backend], base: dict[str, str]) -> dict[str, str]:
        """Start the ``kind`` ("producer" or "consumer") leg span; ``base`` with a
        ``traceparent`` naming it, for every attempt of that leg."""
        span = self._tracer.start_span(
            f"{kind} leg",
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes={"pdproxy.fleet.backends": [b.name for b in candidates]},
        )
        if kind == "producer":
            self._producer = span
        else:
            self._consumer = span
        ctx = span.get_span_context()
        parent = TraceParent(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", int(ctx.trace_flags))
        return {**base, "traceparent": parent.header()}

    def producer_done(self, producer: str | None, retries: int) -> None:
        """The producer phase is over: ``producer`` served it (None: every attempt failed)
        after ``retries`` retries."""
        span = self._producer
        if span is None:
            return
        self._producer_retries = retries
        ok = producer is not None
        if ok:
            span.set_attribute("pdproxy.backend", producer)
        span.set_attributes({"pdproxy.retries": retries,
                             "pdproxy.outcome": "ok" if ok else "failed"})  # fmt: skip
        if not ok:
            span.set_status(Status(StatusCode.ERROR, "every producer attempt failed"))
        span.end()
        self._producer = None

    def end(self, record: RequestRecord, ok: bool, status: int) -> None:
        """The request is over (answer sent, stream ended, client gone, or refused)."""
        outcome = _outcome(ok, status)
        for span in (self._route, self._producer):
            if span is not None:  # the request ended inside this phase
                span.set_attribute("pdproxy.outcome", outcome)
                span.end()
        consumer = self._consumer
        if consumer is not None:
            if record.consumer is not None:
                consumer.set_attribute("pdproxy.backend", record.consumer)
            if record.cached_tokens is not None:
                consumer.set_attribute("pdproxy.cached_tokens", record.cached_tokens)
            consumer.set_attributes({
                "pdproxy.retries": record.retries - self._producer_retries,
                "pdproxy.outcome": outcome,
                "http.response.status_code": status,
            })  # fmt: skip
            if status >= 500:
                consumer.set_status(Status(StatusCode.ERROR))
            consumer.end()
        span = self._span
        span.set_attributes({
            "http.response.status_code": status,
            "pdproxy.dialect": record.dialect,
            "pdproxy.retries": record.retries,
            "pdproxy.fallback": record.fallback,
            "pdproxy.outcome": outcome,
        })  # fmt: skip
        if record.producer is not None:
            span.set_attribute("pdproxy.producer", record.producer)
        if record.producer_cached_tokens is not None:
            span.set_attribute("pdproxy.producer_cached_tokens", record.producer_cached_tokens)
        if record.consumer is not None:
            span.set_attribute("pdproxy.consumer", record.consumer)
        if record.cached_tokens is not None:
            span.set_attribute("pdproxy.cached_tokens", record.cached_tokens)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
