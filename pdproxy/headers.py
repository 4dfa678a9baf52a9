"""Headers: the request id, W3C trace context, and what goes upstream."""

from __future__ import annotations

import os
import re

from starlette.datastructures import Headers

REQUEST_ID = "x-request-id"
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
