"""``pdproxy serve``'s HTTP protocol: uvicorn's httptools protocol that reports a client's
disconnect to the request at once, through its ASGI scope, instead of through ``receive``, and
that keeps connections without a request in progress to their deadline and budgets.

Noticing a client leaving through ASGI takes a task per request blocked in ``receive()``
(:class:`pdproxy.front.cancel.RequestCanceller`'s fallback): creating, scheduling and cancelling it
was ~6% of the instructions of a proxied request. Here each request's scope carries a
:class:`DisconnectHook`; when the connection is lost while the request runs, the protocol calls
the hook's callback right after uvicorn marked the request disconnected (the moment the watcher
task would have woken). Apps served by anything else see no hook and keep the watcher.

Connections (:mod:`pdproxy.front.connections`): a class made by :func:`gated_protocol` passes
each connection through a :class:`~pdproxy.front.connections.ConnectionGate` while it waits for
a request head, caps heads at ``max_head_bytes`` (uvicorn's httptools protocol buffers a head of
any size: 190 MiB in 1.4 s here) and answers 503 past ``max_connections`` requests in progress
(uvicorn's own ``limit_concurrency`` counted every open socket; it is left unset).

The request object of the two hot routes: Starlette's, with headers looked up in O(1).

Starlette's ``Headers.get`` scans the header list and raises (then catches) ``KeyError`` for an
absent header; the request path asks for four or five headers, most of them absent
(``x-request-id``, ``traceparent``, ``baggage``, ...). Here the list is indexed once, keeping
Starlette's answer for a repeated header (the first one), so behaviour is unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from typing import Any, ClassVar

from starlette.datastructures import Headers
from starlette.requests import Request
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdproxy.front.connections import ConnectionGate

DISCONNECT_HOOK = "pdproxy.disconnect_hook"
"""Scope key of the request's :class:`DisconnectHook` (absent: no such server)."""


class DisconnectHook:
    """Set by the server per request: ``lost`` once the client left while the request ran,
    and ``callback`` (set by the request) called then."""

    __slots__ = ("callback", "lost")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.lost = False


class ProxyHttpProtocol(HttpToolsProtocol):
    gate: ClassVar[ConnectionGate | None] = None
    """Set on the class :func:`gated_protocol` makes; None: uvicorn's own connection handling."""

    _source: str | None
    _head_bytes: int
    """Bytes received since the last request ended (or the connection opened) while no head
    was complete: the head being received, at most one read more."""
    _head_done: bool
    _waiting: bool

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_done = False
        self._waiting = False
        gate = self.gate
        if gate is not None:
            self.limit_concurrency = None  # the gate caps requests, not sockets
            self._source = self.client[0] if self.client else None
            self._waiting = True
            gate.wait(self, self._source)

    def data_received(self, data: bytes) -> None:
        gate = self.gate
        if gate is None or self._head_done:
            super().data_received(data)
            return
        self._head_bytes += len(data)
        super().data_received(data)
        if (
            not self._head_done
            and self._head_bytes > gate.max_head_bytes
            and not self.transport.is_closing()
        ):
            gate.refuse(self, "head_too_large")
            self._waiting = False
            self._close_with(431, b"request head too large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[DISCONNECT_HOOK] = DisconnectHook()  # type: ignore[literal-required]

    def on_headers_complete(self) -> None:
        self._head_done = True
        gate = self.gate
        if gate is None:
            super().on_headers_complete()
            return
        if self._waiting:
            self._waiting = False
            gate.done(self)
        if len(self.tasks) < gate.max_in_progress:
            super().on_headers_complete()
            return
        gate.refuse(self, "max_connections")
        app, self.app = self.app, service_unavailable  # 503 + connection: close
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_done = False  # what comes next is the next request's head
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # uvicorn armed its keep-alive timer: the connection waits for its next request.
        gate = self.gate
        if gate is not None and self.timeout_keep_alive_task is not None and not self._waiting:
            self._waiting = True
            gate.wait(self, self._source)

    def expire(self) -> None:
        """Closed by the gate while waiting: 408 when part of a head had arrived."""
        self._waiting = False
        if self.transport.is_closing():
            return
        if self._head_bytes and not self._head_done:
            self._close_with(408, b"request head not received in time")
        else:
            self.transport.close()

    def _close_with(self, status: int, message: bytes) -> None:
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(message), message)
        )
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.gate is not None and self._waiting:
            self._waiting = False
            self.gate.done(self)
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and cycle.disconnected:
            hook = cycle.scope.get(DISCONNECT_HOOK)
            if isinstance(hook, DisconnectHook):
                hook.lost = True
                callback, hook.callback = hook.callback, None
                if callback is not None:
                    callback()


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def gated_protocol(gate: ConnectionGate) -> type[ProxyHttpProtocol]:
    """:class:`ProxyHttpProtocol` whose connections pass ``gate``: the class for uvicorn's
    ``http=`` (uvicorn makes one protocol per connection, from a class)."""

    class GatedProxyHttpProtocol(ProxyHttpProtocol):
        pass

    GatedProxyHttpProtocol.gate = gate
    return GatedProxyHttpProtocol


class IndexedHeaders(Headers):
    """:class:`Headers` whose ``get``/``[]``/``in`` use a dict of each name's first value."""

    def __init__(self, scope: MutableMapping[str, Any]) -> None:
        super().__init__(scope=scope)
        first: dict[bytes, bytes] = {}
        for key, value in reversed(self._list):  # names are lower case in ASGI
            first[key] = value
        self._first = first

    def get(self, key: str, default: Any = None) -> Any:
        value = self._first.get(key.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __getitem__(self, key: str) -> str:
        value = self._first.get(key.lower().encode("latin-1"))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower().encode("latin-1") in self._first


class HotRequest(Request):
    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_headers"):
            self._headers = IndexedHeaders(self.scope)
        return self._headers
