"""A small HTTP/1.1 keep-alive client on asyncio protocols and httptools (the upstream hot path).

Why not aiohttp: measured here, aiohttp's client spends ~0.15-0.25 ms of CPU per request in
its request/response machinery (headers multidicts, URL objects, tracing, timers), which alone
is most of the proxy's budget for two legs. This client does only what the legs need: one write
per request (preformatted head + body), a pooled keep-alive connection per origin, the
response head as a plain dict, and the body either whole or chunk by chunk, with read flow
control. Any error or cancellation aborts the connection (the backend sees the client leave).

Upstreams are not trusted to frame answers honestly; :mod:`pdproxy.upstream.conn` says how each
connection guards against that (1xx, unsolicited bytes, head caps, close-delimited bodies).

Resending. A request is sent again on a fresh connection only when the first try provably
could not have reached the server's application, or when the method is idempotent:

- a pooled connection found closed (or idle past ``idle_s``) is dropped before anything is
  written to it: nothing was sent, so any request simply takes another connection;
- a GET written into a reused connection that closed without a byte of answer is resent once
  (the server most likely closed the idle connection as we wrote; RFC 9112 §9.3.1, as aiohttp
  does for idempotent methods);
- a POST, once written, is never resent here: the server may have read and run it (a prefill
  must not run twice). The caller gets :class:`HttpClientError` and decides. httpcore never
  resends a written request either.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final

from pdproxy.errors import HttpClientError, RequestNotSent
from pdproxy.origin import Origin
from pdproxy.settings import UpstreamSettings
from pdproxy.upstream.conn import Conn

__all__ = ["HostPool", "HttpClientError", "Response", "encode_request"]

_IDEMPOTENT: Final = frozenset({"GET", "OPTIONS", "PUT", "DELETE", "TRACE"})


class Response:
    """A response whose final head has arrived; read the body, then ``release()`` or ``close()``.

    ``headers`` are lower-cased names; a field sent several times holds its values joined with
    ", ". ``trailers`` (same form) are filled once a chunked body ends with some. After
    ``release()`` or ``close()`` the connection is no longer this response's: reading fails,
    closing again does nothing (it never aborts a connection now serving someone else).
    """

    __slots__ = ("_conn", "_pool", "headers", "status", "trailers")

    def __init__(self, conn: Conn, pool: HostPool) -> None:
        self._conn: Conn | None = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers
        self.trailers = conn.trailers

    async def read_chunk(self) -> bytes:
        conn = self._conn
        if conn is None:
            raise HttpClientError("response already released or closed")
        return await conn.read_chunk()

    def chunk_reader(self) -> Callable[[], Awaitable[bytes]]:
        """:meth:`read_chunk` without this object's check on every call, for a relay reading
        the body to its end (one call fewer per chunk); valid until :meth:`release` or
        :meth:`close` (after which it fails: the connection is closed or no longer read)."""
        conn = self._conn
        if conn is None:
            raise HttpClientError("response already released or closed")
        return conn.read_chunk

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; the connection goes back to the pool. Past ``max_bytes`` (or
        ``max_answer_bytes``) reading stops: ResponseTooLarge, the connection closed."""
        conn = self._conn
        if conn is None:
            raise HttpClientError("response already released or closed")
        try:
            body = await conn.read_all(max_bytes)
        except BaseException:
            self.close()
            raise
        self.release()
        return body

    @property
    def at_eof(self) -> bool:
        return self._conn is None or self._conn.at_eof

    def release(self) -> None:
        """Return the connection to the pool if the body was read whole and may be reused."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if conn.reusable:
            self._pool.put(conn)
        else:
            conn.abort()

    def close(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.abort()


class HostPool:
    """Idle keep-alive connections to one origin."""

    def __init__(self, origin: Origin, connect_timeout_s: float, limits: UpstreamSettings) -> None:
        self.origin = origin
        self._connect_timeout_s = connect_timeout_s
        self._idle_s = limits.idle_s
        self._max_idle = limits.max_idle
        self._idle: collections.deque[Conn] = collections.deque()
        self._ssl = ssl_module.create_default_context() if origin.tls else None
        self._factory = partial(Conn, limits, origin.display, origin.tls)

    def put(self, conn: Conn) -> None:
        idle = self._idle
        while idle and idle[0].closed:
            idle.popleft()
        if len(idle) < self._max_idle:
            conn.to_idle()
            idle.append(conn)
        else:
            conn.abort()

    async def _connection(self) -> tuple[Conn, bool]:
        """A connection and whether it was reused from the pool."""
        idle = self._idle
        if idle:
            loop = asyncio.get_running_loop()
            oldest_usable = loop.time() - self._idle_s
            while idle:
                conn = idle.pop()  # the most recently used first
                if conn.idle_since < oldest_usable:
                    # This one and every older one may be closing on the server's side.
                    conn.abort()
                    while idle:
                        idle.pop().abort()
                    break
                if conn.still_idle():  # else dropped: nothing was written to it
                    return conn, True
        origin = self.origin
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    self._factory, origin.host, origin.port, ssl=self._ssl
                )
        except TimeoutError as exc:
            raise RequestNotSent(f"connect to {origin.display} timed out") from exc
        except OSError as exc:
            raise RequestNotSent(f"connect to {origin.display} failed: {exc}") from exc
        if not conn.still_idle():  # the server spoke first, or hung up, before we wrote
            raise RequestNotSent(f"{origin.display} closed a new connection before the request")
        return conn, False

    async def request(
        self, method: str, target: str, headers: dict[str, str], body: bytes = b""
    ) -> Response:
        """Send a request; return once the final response head arrived. Cancellation aborts it.

        ``target`` is the request target as sent (path and query). Raises ValueError for a
        target or header value that would break the request framing.
        """
        data = encode_request(method, target, self.origin.host_header, headers, body)
        resend = method in _IDEMPOTENT
        while True:
            conn, reused = await self._connection()
            head = conn.start(data)
            try:
                await head
            except HttpClientError:
                conn.abort()
                if resend and reused and conn.nothing_received:
                    resend = False
                    continue
                raise
            except BaseException:
                conn.abort()
                raise
            return Response(conn, self)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()


def encode_request(
    method: str, target: str, host: str, headers: dict[str, str], body: bytes
) -> bytes:
    """The request head and body as one buffer (one write).

    Raises ValueError when the target or a header would break the framing (a line break or
    NUL smuggling a header or a second request in).
    """
    if method == "HEAD":
        raise ValueError("HEAD is not supported: its answer's framing differs")
    fields = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    length = len(body)
    head = f"{method} {target} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {length}\r\n{fields}\r\n"
    # One scan of the whole head instead of one per field: exactly our own line breaks.
    lines = len(headers) + 4
    if head.count("\n") != lines or head.count("\r") != lines or "\0" in head:
        raise ValueError(_framing_breaker(target, headers))
    if target[:1] != "/" or " " in target:
        raise ValueError(f"request target {target!r} is not an origin-form path")
    return head.encode("latin-1") + body


def _framing_breaker(target: str, headers: dict[str, str]) -> str:
    for name, value in headers.items():
        if any(c in name or c in value for c in "\r\n\0"):
            return f"header {name!r} holds a line break or NUL"
    return f"request target {target!r} holds a line break or NUL"
