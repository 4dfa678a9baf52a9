"""The hot routes under ``pdproxy serve`` without the ASGI cycle: one :class:`DirectExchange` per
request, driven by :class:`pdproxy.front.protocol.ProxyHttpProtocol`'s parser callbacks.

uvicorn answers every request through a scope dict (a copy of the lifespan state, a parsed URL),
a ``RequestResponseCycle``, the app's dispatch and a Starlette ``Request``; its ``send`` checks
each response header with two regular expressions. For ``POST /v1/completions`` and
``POST /v1/chat/completions`` the protocol builds a :class:`DirectExchange` instead, which is the
connection's current cycle as far as the protocol's own code is concerned (it has the attributes
uvicorn's protocol reads and writes: ``body``, ``more_body``, ``message_event``,
``disconnected``, ``response_complete``, ``keep_alive``, ``run_asgi``), which is the request
the path reads (headers indexed once, ``receive``, the body as it :meth:`~DirectExchange.arrived`)
and which writes the path's response objects, the same ones an ASGI server gets, through its own
:meth:`DirectExchange.send`: one response abstraction (the ASGI messages the path's responses
send), two writers (uvicorn's cycle and this one).

What stays exactly as uvicorn's cycle does it, since clients see it: the status line and
default headers (``date``), chunked framing when no ``content-length`` was given,
``connection: close`` when the request (HTTP/1.0, ``connection: close``) or the server
(shutdown) ends keep-alive, ``100 Continue`` written when the body is first asked for, write
flow control (a paused transport makes ``send`` wait: a slow reader buffers at most the
transport's high-water mark), reading paused past 64 KiB of unread body (nothing is read for a
client beyond that before the path asks: after its key and its admission slot), pipelined
requests queued behind the one in progress, and the request marked disconnected when the
connection is lost before its answer is complete (the protocol then calls the request's
:class:`~pdproxy.front.protocol.DisconnectHook`). An invalid header name or value closes the
connection, as uvicorn's ``send`` raising does.

What differs: the response head is written together with a ``content-length`` body (one
``transport.write``, same bytes) and its headers are checked with one expression for all of
them. Everything here runs on the event loop; :meth:`DirectExchange.run_asgi` is the request's
task (one per request, started by the protocol, owned by uvicorn's ``server_state.tasks`` so
shutdown waits for it), and it is the only writer of the request's answer.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import Message
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pdproxy.errors import BodyTooLarge
from pdproxy.front.intake import Endpoint
from pdproxy.front.request import DISCONNECT_HOOK, DisconnectHook, IndexedHeaders

log = logging.getLogger(__name__)

HOT_URLS = {endpoint.path.encode(): endpoint for endpoint in Endpoint}
"""The request targets served directly: exactly the hot paths, no query, no percent-escapes
(anything else, however equivalent, takes the ASGI route, whose dispatch is the same)."""

_VALID_HEAD = re.compile(
    rb'(?:[^\x00-\x1f\x7f()<>@,;:\[\]={} \t\\"]*: [^\x00-\x08\x0a-\x1f\x7f]*\r\n)*'
)
"""A block of ``name: value\\r\\n`` lines whose names and values uvicorn's two per-header
expressions (``HEADER_RE``, ``HEADER_VALUE_RE``) would both pass."""
_VALID_LOWER_HEAD = re.compile(
    rb'(?:[^\x00-\x1f\x7f()<>@,;:\[\]={} \t\\"A-Z]*: [^\x00-\x08\x0a-\x1f\x7f]*\r\n)*'
)
"""The same, names in lower case (as uvicorn writes them: then they need no lowering)."""

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class HotRoutes(Protocol):
    """Who answers a direct request: :meth:`pdproxy.request.path.RequestPath.answer`."""

    def answer(self, request: Any, endpoint: Endpoint) -> Awaitable[Response]:
        """The response for ``request`` (never raises but for cancellation)."""
        ...


def _nothing() -> None:
    pass


class DirectExchange:
    """One hot request on one connection: its body as the parser delivers it, its task, and
    the writer of its answer. Made by the protocol's ``on_headers_complete``; the protocol
    feeds ``body``/``more_body``/``message_event`` and marks ``disconnected``.

    It is also the request the path reads (a
    :class:`~pdproxy.front.request.ClientRequest`: ``headers``, ``receive``, ``scope`` with the
    request's :class:`~pdproxy.front.request.DisconnectHook`, and :meth:`arrived`)."""

    __slots__ = (
        "_chunked", "_endpoint", "_flow", "_head", "_http_version", "_logger", "_protocol",
        "_remaining",
        "_routes", "_started", "_transport", "body", "disconnected", "headers", "keep_alive",
        "message_event", "more_body", "on_response", "received", "response_complete", "scope",
        "waiting_for_100_continue",
    )  # fmt: skip

    def __init__(
        self,
        protocol: HttpToolsProtocol,
        routes: HotRoutes,
        endpoint: Endpoint,
        headers: list[tuple[bytes, bytes]],
        *,
        keep_alive: bool,
        expect_100_continue: bool,
        http_version: str,
    ) -> None:
        self._protocol = protocol
        self._transport = protocol.transport
        self._flow: FlowControl = protocol.flow
        self._logger = protocol.logger
        self._routes = routes
        self._endpoint = endpoint
        self._http_version = http_version
        self.on_response: Callable[[], None] = protocol.on_response_complete
        self.scope: dict[str, Any] = {"type": "http", DISCONNECT_HOOK: DisconnectHook()}
        self.headers: Headers = IndexedHeaders.of(headers)
        self.message_event = asyncio.Event()
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()
        self.more_body = True
        self.received = False
        """:meth:`receive` was called: the body is being read through it (a queued request
        listens while it waits), so :meth:`arrived` has nothing to give."""
        self.response_complete = False
        self._started = False
        self._chunked = True
        self._remaining = 0
        self._head = b""

    async def run_asgi(self, _app: object = None) -> None:
        """The request's task (the name and argument are uvicorn's: the protocol starts it,
        also for a pipelined request, as it starts a cycle)."""
        try:
            response = await self._routes.answer(self, self._endpoint)
            await response(self.scope, self.receive, self.send)
        except BaseException as exc:
            self._logger.error("Exception in ASGI application\n", exc_info=exc)
            if not self._started:
                await self._send_500()
            else:
                self._transport.close()
        else:
            if not self._started and not self.disconnected:
                self._logger.error("ASGI callable returned without starting response.")
                await self._send_500()
            elif not self.response_complete and not self.disconnected:
                self._logger.error("ASGI callable returned without completing response.")
                self._transport.close()
        finally:
            self.on_response = _nothing

    async def _send_500(self) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": 500,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", b"21"),
                    (b"connection", b"close"),
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": b"Internal Server Error"})

    def arrived(self, limit: int) -> bytes | None:
        """The whole body if it is here already (the parser has seen its end and nothing is
        owed first: no ``100 Continue`` to send, no disconnect to report): what
        :meth:`receive` would hand over, taken without a message, a wait or a deadline timer.
        None: read it through :meth:`receive`. 413 past ``limit``."""
        if self.received or self.more_body or self.waiting_for_100_continue or self.disconnected:
            return None
        body = bytes(self.body)
        if len(body) > limit:
            raise BodyTooLarge(limit)
        self.body = bytearray()
        self.message_event.clear()  # as after receive()'s last message
        return body

    async def receive(self) -> Message:
        """ASGI's ``receive`` as uvicorn's cycle answers it (``100 Continue`` first)."""
        self.received = True
        if self.waiting_for_100_continue and not self._transport.is_closing():
            self._transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self._flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: Mapping[str, Any]) -> None:
        """ASGI's ``send``, written straight to the transport (waits while writing is
        paused: the client reads slower than the answer comes)."""
        if self._flow.write_paused and not self.disconnected:
            await self._flow.drain()
        if self.disconnected:
            return
        if not self._started:
            if message["type"] != "http.response.start":
                raise RuntimeError(
                    f"Expected ASGI message 'http.response.start', but got '{message['type']}'."
                )
            self._start(message["status"], message.get("headers", ()))
            return
        if self.response_complete:
            raise RuntimeError(
                f"Unexpected ASGI message '{message['type']}' sent, after response already "
                "completed."
            )
        if message["type"] != "http.response.body":
            raise RuntimeError(
                f"Expected ASGI message 'http.response.body', but got '{message['type']}'."
            )
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more:
                data += _LAST_CHUNK
        else:
            size = len(body)
            if size > self._remaining:
                raise RuntimeError("Response content longer than Content-Length")
            self._remaining -= size
            data = self._head + body if self._head else body
            self._head = b""
        if data:
            self._transport.write(data)
        if not more:
            if self._remaining != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            self.message_event.set()
            if not self.keep_alive:
                self._transport.close()
            self.on_response()

    def _start(self, status: int, headers: Any) -> None:
        """The response head: written now when chunked, with the body when its length is
        known (the body follows at once)."""
        self._started = True
        self.waiting_for_100_continue = False
        protocol = self._protocol
        if protocol.access_log:
            client = protocol.client
            protocol.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                "%s:%d" % client if client else "",  # noqa: UP031 (uvicorn's own format)
                "POST",
                self._endpoint.path,
                self._http_version,
                status,
            )
        pairs = (*protocol.server_state.default_headers, *headers)
        block = b"".join([b"%s: %s\r\n" % pair for pair in pairs])
        if _VALID_LOWER_HEAD.fullmatch(block) is None:
            # A name not in lower case (uvicorn lowers it), or one it would refuse.
            pairs = tuple((name.lower(), value) for name, value in pairs)
            block = b"".join([b"%s: %s\r\n" % pair for pair in pairs])
            if _VALID_HEAD.fullmatch(block) is None:
                raise RuntimeError("Invalid HTTP header name or value.")
        chunked: bool | None = None
        close = False
        for name, value in pairs:
            if name == b"content-length":
                if chunked is None:
                    self._remaining = int(value)
                    chunked = False
            elif name == b"transfer-encoding":
                if value.lower() == b"chunked":
                    self._remaining = 0
                    chunked = True
            elif name == b"connection" and b"close" in [
                token.lower().strip() for token in value.split(b",")
            ]:
                self.keep_alive = False
                close = True
        if not self.keep_alive and not close:
            block += b"connection: close\r\n"
        if chunked is None and status not in (204, 304):
            chunked = True
            block += b"transfer-encoding: chunked\r\n"
        self._chunked = bool(chunked)
        head = STATUS_LINE[status] + block + b"\r\n"
        if self._chunked or chunked is None:
            self._transport.write(head)
        else:
            self._head = head
