"""OpenAI-shaped error bodies and responses: ``{"error": {"message", "type", "code"}}``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import orjson
from starlette.responses import Response

from pdproxy.errors import ClientRequestError


def error_body(message: str, error_type: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "code": code}})


def error_response(
    status: int,
    message: str,
    *,
    error_type: str = "server_error",
    code: str = "proxy_error",
    headers: Mapping[str, str] | None = None,
) -> Response:
    return Response(
        error_body(message, error_type, code),
        status_code=status,
        headers=dict(headers) if headers else None,
        media_type="application/json",
    )


def client_error_response(
    exc: ClientRequestError, headers: Mapping[str, str] | None = None
) -> Response:
    merged = dict(exc.headers)
    if headers:
        merged.update(headers)
    return error_response(
        exc.status, exc.message, error_type=exc.error_type, code=exc.code, headers=merged
    )


def relayed_response(body: bytes, status: int, headers: Mapping[str, str]) -> Response:
    """``Response(body, status_code=status, headers=headers)``, the same object and raw headers
    (``content-length`` added as Starlette adds it), built without Starlette's generic
    ``__init__``: this runs for every non-stream answer. ``headers``' names are lower case (the
    consumer's relayed headers: :data:`pdproxy.request.consumer._RELAYED_HEADERS`)."""
    response = Response.__new__(Response)
    response.status_code = status
    response.background = None
    response.body = body
    raw = [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    if "content-length" not in headers and not (status < 200 or status in (204, 304)):
        raw.append((b"content-length", b"%d" % len(body)))
    response.raw_headers = raw
    return response


def stream_error_event(message: str, code: str) -> bytes:
    """An SSE event carrying an OpenAI-shaped error, to end a stream that already started."""
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\n"


REDACTED = b"[internal]"


def redact(body: bytes, names: Iterable[str]) -> bytes:
    """``body`` with every occurrence of ``names`` (internal hosts, ``host:port`` pairs)
    replaced by :data:`REDACTED`, longest first so that ``h:p`` goes before ``h``.

    For an engine's 4xx body relayed to the client: it may quote the address of the producer
    it was told to fetch from, which the client must not learn."""
    for name in sorted({n for n in names if n}, key=len, reverse=True):
        body = body.replace(name.encode("utf-8", "replace"), REDACTED)
    return body
