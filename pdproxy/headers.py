"""Headers a leg carries upstream, the client's bearer key, and the debug opt-in."""

from __future__ import annotations

from starlette.datastructures import Headers

from pdproxy.request_ids import REQUEST_ID_HEADER, LegKind, RequestId, leg_request_id

DEBUG_REQUEST = "x-pdproxy-debug"
"""Request header asking for :data:`ROUTE_EXPLAIN` (honoured only with ``debug_headers``)."""
ROUTE_EXPLAIN = "x-pdproxy-route"


def leg_headers(
    base: dict[str, str],
    request_id: RequestId,
    leg: LegKind,
    attempt: int,
    auth_header: str | None,
) -> dict[str, str]:
    """``base`` (content type, validated trace headers) plus this leg's own id
    (:func:`~pdproxy.request_ids.leg_request_id`) and the backend's key."""
    out = dict(base)
    out[REQUEST_ID_HEADER] = leg_request_id(request_id, leg, attempt)
    if auth_header is not None:
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
