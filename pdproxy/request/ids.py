"""Request ids: the proxy's own per request, a fresh one per upstream leg, the client's echoed.

The client's ``X-Request-Id`` is only a label: it is echoed back and logged next to the proxy's
id, never sent upstream. Engines use the ``X-Request-Id`` they receive as their request id (and
vLLM's NIXL connector names the producer's KV supply after it), so a client reusing an id, by
accident or on purpose, would make two requests collide on the engine: later transfers from
that producer fail and recompute. Each leg therefore gets ``<proxy id>-<leg><attempt>``, unique
because the proxy id is 128 random bits.
"""

from __future__ import annotations

import os
import re
from typing import Literal, NewType

from starlette.datastructures import Headers

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
