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

Hot routes (:mod:`pdproxy.front.direct`): a class made with ``hot=`` answers
``POST /v1/completions`` and ``POST /v1/chat/completions`` without the ASGI cycle: the
request's :class:`~pdproxy.front.direct.DirectExchange` takes the place of uvicorn's
``RequestResponseCycle`` (the protocol's own code drives it unchanged: body, pipelining,
keep-alive, disconnect, shutdown) and calls the request path itself. The gate, the head cap
and the 503 at ``max_connections`` come first, as for every request.

Callbacks run on the event loop (they are the transport's and the parser's) and must not block.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdproxy.front.connections import ConnectionGate
from pdproxy.front.direct import HOT_URLS, DirectExchange, HotRoutes
from pdproxy.front.intake import Endpoint
from pdproxy.front.request import DISCONNECT_HOOK, DisconnectHook, HotRequest, IndexedHeaders

__all__ = [
    "DISCONNECT_HOOK",
    "DisconnectHook",
    "HotRequest",
    "IndexedHeaders",
    "ProxyHttpProtocol",
    "gated_protocol",
]


class ProxyHttpProtocol(HttpToolsProtocol):
    gate: ClassVar[ConnectionGate | None] = None
    """Set on the class :func:`gated_protocol` makes; None: uvicorn's own connection handling."""
    hot: ClassVar[HotRoutes | None] = None
    """Who answers the hot routes directly (with a gate only); None: every request is ASGI's."""

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
        if self.hot is not None:
            # uvicorn's scope waits for on_headers_complete: a direct request needs none.
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            return
        super().on_message_begin()
        self.scope[DISCONNECT_HOOK] = DisconnectHook()  # type: ignore[literal-required]

    def on_header(self, name: bytes, value: bytes) -> None:
        # uvicorn's, with the value's trailing whitespace stripped only when there is some
        # (a call per header saved on every request).
        name = name.lower()
        if value and value[-1] in _OWS:
            value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def _asgi_headers_complete(self) -> None:
        if self.hot is not None:
            # uvicorn's scope, made now over the head already parsed (its on_message_begin
            # starts the URL and the header list afresh: they are put back).
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()
            self.url, self.headers, self.expect_100_continue = url, headers, expect
            self.scope["headers"] = headers
            self.scope[DISCONNECT_HOOK] = DisconnectHook()  # type: ignore[literal-required]
        super().on_headers_complete()

    def on_headers_complete(self) -> None:
        self._head_done = True
        gate = self.gate
        if gate is None:
            self._asgi_headers_complete()
            return
        if self._waiting:
            self._waiting = False
            gate.done(self)
        if len(self.tasks) < gate.max_in_progress:
            hot = self.hot
            endpoint = HOT_URLS.get(self.url) if hot is not None else None
            if (
                endpoint is None
                or self.parser.get_method() != b"POST"
                or self.parser.should_upgrade()
                or self.root_path
            ):
                self._asgi_headers_complete()
                return
            assert hot is not None
            self._exchange(hot, endpoint)
            return
        gate.refuse(self, "max_connections")
        app, self.app = self.app, service_unavailable  # 503 + connection: close
        try:
            self._asgi_headers_complete()
        finally:
            self.app = app

    def _exchange(self, hot: HotRoutes, endpoint: Endpoint) -> None:
        """A hot request: its exchange becomes the connection's cycle (queued behind the one
        in progress, as uvicorn queues a pipelined request, with reading paused)."""
        parser = self.parser
        version = parser.get_http_version()
        exchange = DirectExchange(
            self, hot, endpoint, self.headers,
            keep_alive=version != "1.0" and parser.should_keep_alive(),
            expect_100_continue=self.expect_100_continue, http_version=version,
        )  # fmt: skip
        existing = self.cycle
        self.cycle = exchange  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._start_asgi_task(exchange, self.app)  # type: ignore[arg-type]
        else:
            self.flow.pause_reading()
            self.pipeline.appendleft((exchange, self.app))  # type: ignore[arg-type]

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


_OWS = (0x20, 0x09)
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def gated_protocol(gate: ConnectionGate, hot: HotRoutes | None = None) -> type[ProxyHttpProtocol]:
    """:class:`ProxyHttpProtocol` whose connections pass ``gate``: the class for uvicorn's
    ``http=`` (uvicorn makes one protocol per connection, from a class). ``hot``: answers the
    hot routes without ASGI (``pdproxy serve`` passes its app's request path); None: the app
    answers them through ASGI, as under any other server."""

    class GatedProxyHttpProtocol(ProxyHttpProtocol):
        pass

    GatedProxyHttpProtocol.gate = gate
    GatedProxyHttpProtocol.hot = hot
    return GatedProxyHttpProtocol
