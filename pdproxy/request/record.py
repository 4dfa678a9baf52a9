"""Who a request is and what it did: its ids, and the record its end is reported from.

Ids. The client's ``X-Request-Id`` is only a label: it is echoed back and logged next to the
proxy's id, never sent upstream. Engines use the ``X-Request-Id`` they receive as their request
id (and vLLM's NIXL connector names the producer's KV supply after it), so a client reusing an
id, by accident or on purpose, would make two requests collide on the engine: later transfers
from that producer fail and recompute. Each leg therefore gets ``<proxy id>-<leg><attempt>``,
unique because the proxy id is 128 random bits.

The record. The request path owns one :class:`RequestRecord` per request and writes it itself,
from the values its phases return (the route decision,
:class:`~pdproxy.request.producer.ProducerResult`,
:class:`~pdproxy.request.consumer.ConsumerResult`, the relay's
:class:`~pdproxy.request.relay.StreamEnd`); the answer's headers, the metrics, the trace and the
router's outcome are read from it at the end. One exception, on purpose: the phases count their
own retries into :attr:`RequestRecord.retries`, because a phase that retried and then raised
(every consumer failed, the client left) returns nothing, and its retries still belong in the
client's ``x-pdproxy-retries`` and the trace. It is mutable, not a chain of frozen values: the
answer can be cut short at any point (an error, the client leaving), and whatever the request
had reached by then is what its end reports. Nothing is given back from here; that is the
lease's (:mod:`pdproxy.request.lease`).
"""

from __future__ import annotations

import os
import re
from typing import Literal, NewType

from starlette.datastructures import Headers

from pdproxy.front.intake import Endpoint

RequestId = NewType("RequestId", str)
"""The proxy's id for one client request (32 hex digits)."""
LegRequestId = NewType("LegRequestId", str)
"""The ``X-Request-Id`` one upstream leg carries: unique per leg and attempt."""

LegKind = Literal["producer", "consumer", "release"]
REQUEST_ID_HEADER = "x-request-id"
_LEG_SUFFIX = {"producer": "-p", "consumer": "-d", "release": "-r"}
_SANE_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:@+=/-]{1,128}$")


def new_request_id() -> RequestId:
    return RequestId(os.urandom(16).hex())


def leg_request_id(request_id: RequestId, leg: LegKind, attempt: int) -> LegRequestId:
    """``<request id>-p0``, ``-d1``, ``-r0``...: one per upstream call, never reused."""
    return LegRequestId(f"{request_id}{_LEG_SUFFIX[leg]}{attempt}")


def client_request_id(headers: Headers) -> str | None:
    """The client's ``X-Request-Id`` when it is short and plain (safe to log and echo)."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is not None and _SANE_CLIENT_ID.match(given):
        return given
    return None


FALLBACK_HEADER = "x-pdproxy-fallback"
RETRIES_HEADER = "x-pdproxy-retries"

_REQUEST_ID = REQUEST_ID_HEADER.encode()
_RETRIES = RETRIES_HEADER.encode()
_FALLBACK = FALLBACK_HEADER.encode()

Stage = Literal["read", "queue", "route", "producer", "consumer", "stream"]
"""Where a request is (the label of ``pdproxy_disconnect_aborts``)."""


class RequestRecord:
    """One request's identity, where it is, and what it did so far."""

    __slots__ = (
        "cached_tokens", "client_request_id", "consumer", "consumer_first_byte_s", "dialect",
        "endpoint", "fallback", "hides_cached_tokens", "kv_peer", "producer",
        "producer_cached_tokens", "producer_s", "request_id",
        "retries", "route_s", "stage", "t0",
    )  # fmt: skip

    def __init__(
        self, request_id: RequestId, client_request_id: str | None, endpoint: Endpoint, t0: float
    ) -> None:
        self.request_id = request_id
        self.client_request_id = client_request_id
        """The client's own ``X-Request-Id`` when usable: echoed, logged, never sent upstream."""
        self.endpoint = endpoint
        self.t0 = t0
        """When the request arrived (``time.perf_counter``): time to first byte counts from it."""
        self.stage: Stage = "read"
        self.dialect = "none"
        """The dialect of the candidates the request was routed among (``none``: not routed)."""
        self.retries = 0
        """Legs sent after a first one failed, both phases together (the phases count them)."""
        self.fallback = False
        """The consumer prefilled alone after the producer phase failed or its KV did."""
        self.producer: str | None = None
        """The producer that served the producer leg; None when none did."""
        self.kv_peer: str | None = None
        """The KV address the producer's answer named (``remote_host``): internal, never shown
        to the client (a consumer's refusal quoting it is redacted)."""
        self.consumer: str | None = None
        """The consumer that answered (a refusal included); after a migration, the last one."""
        self.cached_tokens: int | None = None
        """``usage.prompt_tokens_details.cached_tokens`` from the consumer, when reported."""
        self.producer_cached_tokens: int | None = None
        """The same from the producer leg's answer (the producer's own prefix-cache hit)."""
        self.hides_cached_tokens = False
        """The client may not see ``cached_tokens``: its answer shows 0 (the figure above stays
        the engine's, for the metrics)."""
        self.route_s = 0.0
        self.producer_s = 0.0
        self.consumer_first_byte_s = 0.0

    def client_headers(self, server_timing: bool) -> list[tuple[bytes, bytes]]:
        """Headers every answer to the client carries (raw, ASGI's form): its own request id
        echoed (the proxy's when it sent none or an unusable one), timings, retry and fallback
        markers."""
        headers = [(_REQUEST_ID, (self.client_request_id or self.request_id).encode())]
        if server_timing:
            headers.append((b"server-timing", self.server_timing().encode()))
        if self.retries:
            headers.append((_RETRIES, str(self.retries).encode()))
        if self.fallback:
            headers.append((_FALLBACK, b"consumer-only"))
        return headers

    def server_timing(self) -> str:
        parts = [f"route;dur={self.route_s * 1000:.3f}"]
        if self.producer_s:
            parts.append(f"producer;dur={self.producer_s * 1000:.3f}")
        if self.consumer_first_byte_s:
            parts.append(f"consumer_fb;dur={self.consumer_first_byte_s * 1000:.3f}")
        return ", ".join(parts)
