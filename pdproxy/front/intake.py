"""Taking a client request in: the endpoint it was sent to, its API key, its body (size- and
time-limited while read), and the gate on ``kv_transfer_params``.

Decode and re-encode client JSON bodies without re-typing anything.

orjson is used for speed. It turns integers beyond 64 bits into floats, so a body holding a
run of 19 or more digits (possibly such an integer) goes through the standard library instead,
which keeps big integers exact. Floats round-trip exactly either way: both encoders write the
shortest representation that reads back as the same double (``0.9`` stays ``0.9``).

Nesting: orjson reads up to 1024 levels but writes only 255 (deeper bodies are written by the
standard library), and the standard library recurses until ``RecursionError``; a body nested
too deep to read or to write again is a 400, never a 500.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NewType

import orjson
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from pdproxy.errors import BodyReadTimeout, BodyTooLarge, ClientRequestError
from pdproxy.settings import ApiKey


class Endpoint(StrEnum):
    """An OpenAI endpoint the proxy serves. Its value is its name everywhere a name is shown:
    the ``route`` label of the metrics, ``RouteRequest.endpoint``, the trace's
    ``pdproxy.route``. Its :attr:`path` is where clients post it and where both legs go."""

    path: str
    """``/v1/completions``: the client's path, and the upstream path of every leg."""

    def __new__(cls, name: str, path: str) -> Endpoint:
        member = str.__new__(cls, name)
        member._value_ = name
        member.path = path  # a plain attribute: read on every leg, never a call
        return member

    COMPLETIONS = "completions", "/v1/completions"
    CHAT = "chat", "/v1/chat/completions"


ENDPOINTS = {endpoint.path: endpoint for endpoint in Endpoint}
"""Each endpoint by its path (the app's dispatch)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


TenantId = NewType("TenantId", str)
"""Whose prefix cache a request may use: ``name:<tenant>`` for a key's configured ``tenant``,
``key:<sha-256 of the key>`` for a key of its own (never the key itself)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as far as the proxy's gates care (:meth:`ClientKeys.authenticate`)."""

    trusted: bool
    """May send its own ``kv_transfer_params``."""
    tenant: TenantId | None
    """Its tenant; None when every caller shares one cache (no keys, or ``share_prefixes``)."""
    sees_cached_tokens: bool
    """Its answers show the engine's ``cached_tokens`` (else 0)."""
    ttft_class: str | None = None
    """Its key's TTFT class (None: the router's default)."""
    key_scope: str | None = None
    """What scopes its sessions (affinity): a digest of its key, computed once per key. None
    when no keys are configured: sessions are then scoped by whatever bearer token the client
    sent (:func:`pdproxy.routing.session.session_of` reads it only for a request that names a
    session)."""


ANONYMOUS = Caller(trusted=False, tenant=None, sees_cached_tokens=True)
"""Every caller when no keys are configured: one tenant, nothing to hide from anyone."""


def _caller(key: ApiKey, digest: bytes, share_prefixes: bool) -> Caller:
    tenant = None
    if not share_prefixes:
        tenant = TenantId(f"name:{key.tenant}" if key.tenant is not None else f"key:{digest.hex()}")
    return Caller(
        key.trusted, tenant, key.see_cached_tokens, key.ttft_class, key_scope=digest[:8].hex()
    )


class ClientKeys:
    """The configured client keys; none configured means no authentication."""

    def __init__(self, keys: list[ApiKey], *, share_prefixes: bool = False) -> None:
        # Keyed by digest: a dict lookup compares the presented value with a stored one byte by
        # byte, and that timing may only ever reveal digests, never a prefix of a real key.
        # Each key's caller is made once here: a request costs one lookup.
        self._callers: dict[bytes, Caller] = {}
        for k in keys:
            digest = _digest(k.key.get_secret_value())
            self._callers[digest] = _caller(k, digest, share_prefixes)

    @property
    def required(self) -> bool:
        return bool(self._callers)

    def authenticate(self, headers: Headers) -> Caller:
        """Check the caller's bearer key; say who it is. 401 if wrong."""
        if not self._callers:
            return ANONYMOUS
        token = bearer_token(headers)
        caller = self._callers.get(_digest(token)) if token is not None else None
        if caller is None:
            raise ClientRequestError(401, "invalid or missing API key", code="invalid_api_key")
        return caller


class _Deadline:
    """Cancels the reading task when called (by the loop's timer); remembers that it did."""

    __slots__ = ("_task", "fired")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self._task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self._task.cancel()


def check_declared_size(headers: Headers, limit: int) -> None:
    """413 at once when ``content-length`` already says the body is too large."""
    declared = headers.get("content-length")
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


_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))
_LONG_RUN = b"0" * 19


def has_long_digit_run(raw: bytes) -> bool:
    """A run of 19 or more ASCII digits (possibly an integer beyond 64 bits). ``translate`` +
    ``find`` run at memory speed (~8 ms for 4 MiB here) where ``re`` took ~90 ms, on the event
    loop, for every large body."""
    return raw.translate(_DIGITS_AS_ZERO).find(_LONG_RUN) >= 0


@dataclass(frozen=True, slots=True)
class ClientBody:
    """A client's JSON object body: the raw bytes, the parsed mapping and its codec."""

    raw: bytes
    data: dict[str, Any]
    exact_ints: bool
    """True when the standard library decoded it (big integers present)."""

    def encode(self, data: dict[str, Any]) -> bytes:
        """Serialise an edited copy of ``data`` with the same codec that decoded it."""
        if not self.exact_ints:
            try:
                return orjson.dumps(data)
            except orjson.JSONEncodeError:
                pass  # deeper than orjson writes (255): the standard library may manage
        try:
            return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        except (RecursionError, ValueError) as exc:
            raise ClientRequestError(400, "request body is nested too deeply") from exc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_body(raw: bytes) -> ClientBody:
    """Parse a request body; raises a 400 :class:`ClientRequestError` unless a JSON object."""
    exact = has_long_digit_run(raw)
    try:
        data = json.loads(raw, parse_constant=_reject_constant) if exact else orjson.loads(raw)
    except ValueError as exc:
        raise ClientRequestError(400, f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise ClientRequestError(400, "request body is nested too deeply") from exc
    if not isinstance(data, dict):
        raise ClientRequestError(400, "request body must be a JSON object")
    if exact:
        # The standard library accepts escaped lone surrogates ("\ud800") that orjson refuses and
        # that no leg could be encoded with; refuse them here as orjson would.
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except RecursionError as exc:
            raise ClientRequestError(400, "request body is nested too deeply") from exc
        except UnicodeEncodeError as exc:
            raise ClientRequestError(
                400, "request body is not valid JSON: lone surrogate in a string"
            ) from exc
    return ClientBody(raw=raw, data=data, exact_ints=exact)


DEBUG_REQUEST = "x-pdproxy-debug"
"""Request header asking for :data:`ROUTE_EXPLAIN` (honoured only with ``debug_headers``)."""
ROUTE_EXPLAIN = "x-pdproxy-route"


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


TTFT_CLASS_HEADER = "x-pdproxy-ttft-class"
TTFT_TARGET_HEADER = "x-pdproxy-ttft-target-ms"
_MAX_TARGET_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class LatencyAsk:
    """The TTFT class and target a request is routed with."""

    ttft_class: str | None
    target_ms: float | None


NO_LATENCY_ASK = LatencyAsk(None, None)


def latency_ask(headers: Headers, caller: Caller) -> LatencyAsk:
    """The caller's key's class; a trusted caller may name another class
    (``x-pdproxy-ttft-class``) or a target of its own (``x-pdproxy-ttft-target-ms``). An
    untrusted caller's headers are ignored: a class or a target is a claim on the pool's
    capacity (``batch`` yields to ``interactive``, shedding spares what is not sheddable) that
    only the operator hands out, through keys."""
    if not caller.trusted:
        return NO_LATENCY_ASK if caller.ttft_class is None else LatencyAsk(caller.ttft_class, None)
    klass = headers.get(TTFT_CLASS_HEADER)
    if klass is not None and not (0 < len(klass) <= 64 and klass.isprintable()):
        raise ClientRequestError(400, f"{TTFT_CLASS_HEADER} must be a class name")
    target = headers.get(TTFT_TARGET_HEADER)
    target_ms = None
    if target is not None:
        try:
            target_ms = float(target)
        except ValueError:
            target_ms = -1.0
        if not 0.0 < target_ms <= _MAX_TARGET_MS:  # NaN fails too
            raise ClientRequestError(
                400, f"{TTFT_TARGET_HEADER} must be milliseconds in (0, {_MAX_TARGET_MS:.0f}]"
            )
    if klass is None and target_ms is None:
        return NO_LATENCY_ASK if caller.ttft_class is None else LatencyAsk(caller.ttft_class, None)
    return LatencyAsk(klass if klass is not None else caller.ttft_class, target_ms)
