"""W3C trace context (``traceparent``, ``tracestate``) and ``baggage``: validated, size-capped.

Clients are untrusted, and whatever the proxy forwards lands in every leg's request head: an
oversized or malformed trace header that an engine refuses would fail the request on every
backend. So a header is forwarded only when it is well formed and within the sizes the specs
ask implementations to propagate (tracestate: 32 members, 512 bytes kept; baggage: 64 members,
8192 bytes); anything else is dropped (never truncated: a cut value could change its meaning).
A ``tracestate`` without a valid ``traceparent`` is dropped too, as the spec says.
"""

from __future__ import annotations

import re

from starlette.datastructures import Headers

TRACEPARENT_MAX = 55 + 64
"""Version 00 is 55 characters; later versions may append fields, bounded here."""
TRACESTATE_MAX_BYTES = 512
TRACESTATE_MAX_MEMBERS = 32
BAGGAGE_MAX_BYTES = 8192
BAGGAGE_MAX_MEMBERS = 64

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?$")
_TRACESTATE_KEY = re.compile(
    r"^(?:[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13}|[a-z][a-z0-9_\-*/]{0,255})$"
)
_TRACESTATE_VALUE = re.compile(
    r"^[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]$"
)
_BAGGAGE_KEY = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BAGGAGE_VALUE = re.compile(r"^[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*$")


def valid_traceparent(value: str) -> bool:
    if len(value) > TRACEPARENT_MAX:
        return False
    m = _TRACEPARENT.match(value)
    if m is None:
        return False
    version, trace_id, parent_id, _flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def valid_tracestate(value: str) -> bool:
    if len(value.encode("latin-1", "replace")) > TRACESTATE_MAX_BYTES:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    if not members or len(members) > TRACESTATE_MAX_MEMBERS:
        return False
    keys: set[str] = set()
    for member in members:
        key, eq, val = member.partition("=")
        if not eq or not _TRACESTATE_KEY.match(key) or not _TRACESTATE_VALUE.match(val):
            return False
        if key in keys:
            return False
        keys.add(key)
    return True


def valid_baggage(value: str) -> bool:
    if len(value.encode("latin-1", "replace")) > BAGGAGE_MAX_BYTES:
        return False
    members = value.split(",")
    if len(members) > BAGGAGE_MAX_MEMBERS:
        return False
    for member in members:
        entry, _, _properties = member.partition(";")
        key, eq, val = entry.partition("=")
        if not eq or not _BAGGAGE_KEY.match(key.strip(" \t")):
            return False
        if not _BAGGAGE_VALUE.match(val.strip(" \t")):
            return False
    return True


def trace_headers(headers: Headers) -> dict[str, str]:
    """The client's trace headers that may be forwarded upstream (possibly none)."""
    out: dict[str, str] = {}
    parent = headers.get("traceparent")
    if parent is not None and valid_traceparent(parent):
        out["traceparent"] = parent
        state = headers.get("tracestate")
        if state is not None and valid_tracestate(state):
            out["tracestate"] = state
    baggage = headers.get("baggage")
    if baggage is not None and valid_baggage(baggage):
        out["baggage"] = baggage
    return out
