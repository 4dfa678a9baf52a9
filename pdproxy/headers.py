"""Headers: the request id, W3C trace context, what goes upstream, and the debug header."""

from __future__ import annotations

import json
import os
import re

from starlette.datastructures import Headers

from pdproxy.routing.base import RouteDecision
from pdproxy.routing.kv.explain import debug_header_value

REQUEST_ID = "x-request-id"
DEBUG_REQUEST = "x-pdproxy-debug"
"""Request header asking for :data:`ROUTE_EXPLAIN` (honoured only with ``debug_headers``)."""
ROUTE_EXPLAIN = "x-pdproxy-route"
TRACE_HEADERS = ("traceparent", "tracestate", "baggage")
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@+=/-]{1,128}$")


def request_id_for(headers: Headers) -> str:
    """The client's ``X-Request-Id`` when it is sane, else a fresh random one."""
    given = headers.get(REQUEST_ID)
    if given is not None and _SANE_REQUEST_ID.match(given):
        return given
    return os.urandom(16).hex()


def upstream_base_headers(headers: Headers, request_id: str) -> dict[str, str]:
    """Headers every leg of this request carries (before per-backend Authorization)."""
    out = {"content-type": "application/json", REQUEST_ID: request_id}
    for name in TRACE_HEADERS:
        value = headers.get(name)
        if value is not None:
            out[name] = value
    return out


def with_backend_auth(base: dict[str, str], auth_header: str | None) -> dict[str, str]:
    if auth_header is None:
        return base
    out = dict(base)
    out["authorization"] = auth_header
    return out


def bearer_token(headers: Headers) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def wants_route_explain(headers: Headers) -> bool:
    """The client sent ``x-pdproxy-debug: 1`` (or ``true``)."""
    value = headers.get(DEBUG_REQUEST)
    return value is not None and value.strip().lower() in ("1", "true")


def route_explain_value(decision: RouteDecision) -> str:
    """Compact ASCII JSON explaining ``decision``: the KV router's scores when it gave some,
    else just the router's reason (``{"reason":"round-robin"}``)."""
    if decision.explain:
        return debug_header_value(decision)
    return json.dumps({"reason": decision.reason}, separators=(",", ":"), ensure_ascii=True)
