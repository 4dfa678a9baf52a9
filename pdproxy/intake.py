"""Taking a client request in: its API key, its body (size- and time-limited while read), and
the gate on ``kv_transfer_params``."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message, Receive

from pdproxy.errors import BodyReadTimeout, BodyTooLarge, ClientRequestError
from pdproxy.headers import bearer_token
from pdproxy.settings import ApiKey


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ClientKeys:
    """The configured client keys; none configured means no authentication."""

    def __init__(self, keys: list[ApiKey]) -> None:
        # Keyed by digest: a dict lookup compares the presented value with a stored one byte by
        # byte, and that timing may only ever reveal digests, never a prefix of a real key.
        self._trusted = {_digest(k.key.get_secret_value()): k.trusted for k in keys}

    @property
    def required(self) -> bool:
        return bool(self._trusted)

    def authenticate(self, headers: Headers) -> bool:
        """Check the caller's bearer key; return whether it is trusted. 401 if wrong."""
        if not self._trusted:
            return False
        token = bearer_token(headers)
        trusted = self._trusted.get(_digest(token)) if token is not None else None
        if trusted is None:
            raise ClientRequestError(401, "invalid or missing API key", code="invalid_api_key")
        return trusted


class _Deadline:
    """Cancels the reading task when called (by the loop's timer); remembers that it did."""

    __slots__ = ("_task", "fired")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self._task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self._task.cancel()


def check_declared_size(request: Request, limit: int) -> None:
    """413 at once when ``content-length`` already says the body is too large."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)


async def read_body(
    receive: Receive, limit: int, timeout_s: float, received: list[Message] | None = None
) -> bytes:
    """The whole body (after the ``received`` messages, taken while queued): 413 as soon as it
    exceeds ``limit`` bytes, 408 if it has not arrived within ``timeout_s`` (a slow sender must
    not hold its slot and buffer for ever), ``ClientDisconnect`` if the client left.

    One plain loop timer rather than ``asyncio.timeout``: this runs for every request, and the
    timer costs a fraction of the context manager's Python calls."""
    task = asyncio.current_task()
    assert task is not None
    deadline = _Deadline(task)
    timer = asyncio.get_running_loop().call_later(timeout_s, deadline)
    chunks: list[bytes] = []
    size = 0
    pending = list(received or ())
    try:
        while True:
            message = pending.pop(0) if pending else await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except asyncio.CancelledError:
        if not deadline.fired:
            raise
        task.uncancel()
        raise BodyReadTimeout(timeout_s) from None
    finally:
        timer.cancel()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_kv_params(data: Mapping[str, Any], trusted: bool) -> bool:
    """True when the request passes its own ``kv_transfer_params`` through (trusted caller);
    400 for anyone else who tries. They count at the top level and inside ``vllm_xargs`` (which
    vLLM merges into the request's extra arguments): either names hosts an engine would
    connect to."""
    if "kv_transfer_params" not in data:
        xargs = data.get("vllm_xargs")
        if not isinstance(xargs, Mapping) or "kv_transfer_params" not in xargs:
            return False
    if not trusted:
        raise ClientRequestError(
            400,
            "kv_transfer_params may not be set by clients",
            code="kv_transfer_params_not_allowed",
        )
    return True
