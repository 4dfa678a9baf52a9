"""W3C trace context (``traceparent``, ``tracestate``) and ``baggage``: validated, size-capped.

Clients are untrusted, and whatever the proxy forwards lands in every leg's request head: an
oversized or malformed trace header that an engine refuses would fail the request on every
backend. So a header is forwarded only when it is well formed and within the sizes the specs
ask implementations to propagate (tracestate: 32 members, 512 bytes kept; baggage: 64 members,
8192 bytes); anything else is dropped (never truncated: a cut value could change its meaning).
A ``tracestate`` without a valid ``traceparent`` is dropped too, as the spec says.

:class:`TraceParent` is the one parsed form of a ``traceparent``: validation uses it, and the
proxy's own spans (:mod:`pdproxy.request.trace`, when tracing is on) continue a client's trace from
it and name themselves to the engine legs with :meth:`TraceParent.child`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


SAMPLED = 0x01
"""The ``sampled`` bit of ``trace-flags``."""


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid W3C ``traceparent``: which trace, which parent span, and its flags."""

    trace_id: str
    """32 lower-case hex digits, not all zero."""
    parent_id: str
    """16 lower-case hex digits, not all zero: the span the next hop is a child of."""
    flags: int

    @classmethod
    def parse(cls, value: str) -> TraceParent | None:
        """The parsed header, or None when it is malformed or oversized. A later version's
        extra fields are accepted and not kept (a version-00 implementation reads the first
        four fields of any later version, and propagates version 00)."""
        if len(value) > TRACEPARENT_MAX:
            return None
        m = _TRACEPARENT.match(value)
        if m is None:
            return None
        version, trace_id, parent_id, flags, rest = m.groups()
        if version == "ff" or (version == "00" and rest):
            return None
        if trace_id == "0" * 32 or parent_id == "0" * 16:
            return None
        return cls(trace_id, parent_id, int(flags, 16))

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    def child(self, span_id: str, sampled: bool) -> TraceParent:
        """The same trace with ``span_id`` as the parent of the next hop."""
        flags = (self.flags | SAMPLED) if sampled else (self.flags & ~SAMPLED)
        return TraceParent(self.trace_id, span_id, flags)

    def header(self) -> str:
        """The version-00 header value."""
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags:02x}"


def valid_traceparent(value: str) -> bool:
    return TraceParent.parse(value) is not None


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
