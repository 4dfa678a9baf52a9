"""The hot routes: which endpoint a path is, and their indexed headers, which answer exactly as
Starlette's ``Headers`` (property test)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from pdproxy.front.intake import ENDPOINTS, Endpoint
from pdproxy.front.protocol import IndexedHeaders

_NAMES = st.sampled_from(
    [b"authorization", b"x-request-id", b"content-length", b"traceparent", b"baggage", b"x-a"]
)
_VALUES = st.binary(min_size=0, max_size=8).filter(lambda v: b"\r" not in v and b"\n" not in v)
_LOOKUPS = ["Authorization", "x-request-id", "CONTENT-LENGTH", "traceparent", "baggage", "x-b"]


@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=8))
def test_indexed_headers_answer_as_starlette_headers(raw: list[tuple[bytes, bytes]]) -> None:
    plain = Headers(scope={"headers": list(raw)})
    indexed = IndexedHeaders({"headers": list(raw)})
    for name in _LOOKUPS:
        assert indexed.get(name) == plain.get(name)
        assert indexed.get(name, "absent") == plain.get(name, "absent")
        assert (name in indexed) == (name in plain)
        assert indexed.getlist(name) == plain.getlist(name)
    assert indexed.raw == plain.raw


def test_each_endpoint_is_its_path_and_its_name() -> None:
    assert ENDPOINTS == {
        "/v1/completions": Endpoint.COMPLETIONS,
        "/v1/chat/completions": Endpoint.CHAT,
    }
    # The name is what metrics, routers and traces have always been given: the plain string.
    assert [str(e) for e in Endpoint] == ["completions", "chat"]
    assert Endpoint("chat") is Endpoint.CHAT and Endpoint.CHAT == "chat"
