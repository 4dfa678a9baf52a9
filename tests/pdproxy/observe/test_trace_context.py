"""Trace headers: whatever a client sends, what is forwarded is well formed and bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from pdproxy.observe.trace_context import (
    BAGGAGE_MAX_BYTES,
    SAMPLED,
    TRACEPARENT_MAX,
    TRACESTATE_MAX_BYTES,
    TraceParent,
    trace_headers,
    valid_traceparent,
)

_HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=9000)


@given(parent=_HEADER_TEXT, state=_HEADER_TEXT, baggage=_HEADER_TEXT)
def test_forwarded_trace_headers_are_bounded(parent: str, state: str, baggage: str) -> None:
    headers = Headers(
        raw=[
            (b"traceparent", parent.encode("latin-1")),
            (b"tracestate", state.encode("latin-1")),
            (b"baggage", baggage.encode("latin-1")),
        ]
    )
    out = trace_headers(headers)
    assert len(out.get("traceparent", "")) <= TRACEPARENT_MAX
    assert len(out.get("tracestate", "")) <= TRACESTATE_MAX_BYTES
    assert len(out.get("baggage", "")) <= BAGGAGE_MAX_BYTES
    assert "tracestate" not in out or "traceparent" in out


def test_traceparent_rules() -> None:
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert valid_traceparent(good)
    assert not valid_traceparent(good.upper())  # lower-case hex only
    assert not valid_traceparent("ff" + good[2:])  # version ff is forbidden
    assert not valid_traceparent(good + "-extra")  # version 00 has exactly four fields
    assert valid_traceparent("01" + good[2:] + "-future")  # later versions may add fields
    assert not valid_traceparent(good.replace("b7ad6b7169203331", "0" * 16))


@given(
    trace_id=st.integers(1, 2**128 - 1),
    span_id=st.integers(1, 2**64 - 1),
    flags=st.integers(0, 255),
    child=st.integers(1, 2**64 - 1),
    sampled=st.booleans(),
)
def test_traceparent_round_trips_and_children_stay_in_the_trace(
    trace_id: int, span_id: int, flags: int, child: int, sampled: bool
) -> None:
    parent = TraceParent(f"{trace_id:032x}", f"{span_id:016x}", flags)
    assert TraceParent.parse(parent.header()) == parent
    assert valid_traceparent(parent.header())
    kid = parent.child(f"{child:016x}", sampled)
    assert TraceParent.parse(kid.header()) == kid
    assert kid.trace_id == parent.trace_id
    assert kid.sampled is sampled
    assert kid.flags & ~SAMPLED == flags & ~SAMPLED  # the other flags travel unchanged


def test_later_version_is_read_and_propagated_as_version_00() -> None:
    later = "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03-future"
    parsed = TraceParent.parse(later)
    assert parsed == TraceParent("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", 3)
    assert parsed.header() == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03"
