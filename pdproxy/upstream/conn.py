"""One upstream HTTP/1.1 connection: an asyncio protocol reading responses with httptools.

The upstream is not trusted to frame its answers honestly. A connection moves through

    IDLE --start()--> HEAD --final head--> BODY --message complete / EOF--> DONE --release--> IDLE

and every byte is checked against that state:

- HEAD skips interim responses (100, 103, ... any number of them, each with headers); the final
  response is the first non-1xx one. ``101 Switching Protocols`` is refused: the proxy never
  asks for an upgrade. httpcore and aiohttp skip 1xx the same way (both return 101 to their
  caller instead; nothing here could use it).
- Bytes (or EOF) that arrive while IDLE, or after the final response is complete, were asked
  for by nobody: the connection is closed at once and never reused, so they cannot be taken as
  the answer to the next client's request. httpcore treats an idle socket that turns readable as
  expired; aiohttp closes a connection with unparsed tail bytes instead of pooling it.
- The head is capped in bytes (interim heads included, so an endless run of ``100 Continue`` is
  bounded too) and in fields per head, like h11's 16 KiB incomplete-event cap and aiohttp's
  ``max_field_size``/``max_headers``; trailers of a chunked body get the same caps. A body read
  whole (``read_all``) is capped at ``max_answer_bytes``; streamed bodies are relayed, not held.
- A response with neither ``content-length`` nor chunked framing is read until the server
  closes (a clean EOF ends it; a reset is an error), and its connection is not reused.
- Repeated header fields are joined with ", " (RFC 9110 §5.3) rather than the last one winning;
  no field the proxy reads (content-type, retry-after) is legitimately repeated, and nothing is
  lost silently.

HEAD requests are not supported: the parser cannot know that their answer has no body.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import select
from typing import Final, cast

import httptools

from pdproxy.errors import HttpClientError, ResponseHeadTooLarge, ResponseTooLarge
from pdproxy.settings import UpstreamSettings

log = logging.getLogger(__name__)

MAX_BUFFERED: Final = 256 * 1024
"""Unread body bytes past which reading from the socket pauses (flow control)."""

IDLE: Final = 0
HEAD: Final = 1
BODY: Final = 2
DONE: Final = 3


class _Unsolicited(Exception):
    """Raised inside a parser callback: a second message began after the final response."""


class Conn(asyncio.Protocol):
    """One connection; carries one request at a time. Owned by a pool or by one Response."""

    def __init__(self, limits: UpstreamSettings, label: str, tls: bool) -> None:
        self._loop = asyncio.get_running_loop()
        self._label = label
        self._tls = tls
        self._poll: select.poll | None = None
        self._max_head_bytes = limits.max_head_bytes
        self._max_answer_bytes = limits.max_answer_bytes
        self._max_fields = limits.max_header_fields
        self.transport: asyncio.Transport | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        # httptools' body callback is the deque's own append (no Python frame per chunk of a
        # stream); the parser looks its callbacks up once, so this comes before it.
        self.on_body = self._chunks.append
        self._parser = httptools.HttpResponseParser(self)
        self.state = IDLE
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._buffered = 0
        self._paused = False
        self._error: HttpClientError | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self._filling = self.headers
        self._repeats = 0
        self._field_bytes = 0
        self._framing_bytes = 0
        self._framed = False
        self.keep_alive = False
        self.closed = False
        self.nothing_received = True
        self.idle_since = 0.0

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and not self._tls:
            # Registered once; checked before each reuse. TLS sockets turn readable for
            # records that carry no data (session tickets), so they rely on data_received.
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state in (IDLE, DONE):
            self._unsolicited(len(data))
            return
        self.nothing_received = False
        size = len(data)
        self._framing_bytes += size  # reset below when the read held body data
        self._buffered += size  # framing included: counted once per read, not per body chunk
        chunks = self._chunks
        held = len(chunks)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _Unsolicited):
                self._unsolicited(0)
            elif isinstance(cause, HttpClientError):
                self._fail(cause)
                return
            else:
                self._fail(HttpClientError(f"response handling failed: {cause!r}"))
                return
        except httptools.HttpParserError as exc:
            if self.state == DONE:
                self._unsolicited(0)  # garbage after a complete response
            else:
                self._fail(HttpClientError(f"invalid HTTP response: {exc}"))
                return
        except httptools.HttpParserUpgrade:
            self._fail(HttpClientError("unexpected protocol upgrade"))
            return
        if len(chunks) != held:
            self._framing_bytes = 0  # body data came: what is counted is no head or trailer
        if self._framing_bytes > self._max_head_bytes and self.state != DONE:
            # Bytes that are no body data, past the cap: a head or trailer line that never
            # ends, too many fields, endless 1xx. httptools would buffer a partial field.
            self._fail(ResponseHeadTooLarge(self._over_cap()))
            return
        # Once per read, not per body chunk: wake the reader, apply flow control.
        if chunks or self.state == DONE:
            if self._buffered > MAX_BUFFERED and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
            waiter = self._waiter  # _wake(), inline: this runs for every read of a stream
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state = self.state
        if state == BODY and not self._framed and exc is None and self._error is None:
            # A close-delimited body: the server's clean close is its end.
            self.state = DONE
            self.keep_alive = False
            self._wake()
        elif state in (HEAD, BODY):
            self._fail(HttpClientError(f"connection closed early: {exc!r}"))

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        # The hot path: the caps are checked once per head (a single read is at most 256 KiB,
        # and a head spread over reads is capped in data_received); only repeats, whose
        # joining costs more, are checked here.
        key = name.decode("latin-1").lower()
        fields = self._filling
        if key in fields:
            self._repeated(fields, key, value)
        else:
            fields[key] = value.decode("latin-1")

    def on_message_begin(self) -> None:
        # One call per message: the first byte of anything behind the final answer (even a
        # status line cut short) is caught here, before it could be read as the next answer.
        if self.state == DONE:
            raise _Unsolicited

    def on_headers_complete(self) -> None:
        self._check_fields(self.headers)
        status = self._parser.get_status_code()
        if status < 200:
            if status == 101:
                raise HttpClientError("upstream switched protocols (101) unasked")
            # Interim response: forget it; its bytes still count against the head cap.
            self.headers = self._filling = {}
            self._repeats = 0
            return
        # Fields after the head are trailers of a chunked body, with a budget of their own.
        self._filling = self.trailers
        self._field_bytes = 0
        self._repeats = 0
        self._framing_bytes = 0
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        headers = self.headers
        self._framed = "content-length" in headers or headers.get(
            "transfer-encoding", ""
        ).lower().endswith("chunked")
        self.state = BODY
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_message_complete(self) -> None:
        if self.state == BODY:  # an interim response's end changes nothing
            if self.trailers:
                self._check_fields(self.trailers)
            self.state = DONE

    # -- internals

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _repeated(self, fields: dict[str, str], key: str, value: bytes) -> None:
        self._repeats += 1
        if len(fields) + self._repeats > self._max_fields:
            raise ResponseHeadTooLarge(f"more than {self._max_fields} header fields")
        fields[key] = f"{fields[key]}, {value.decode('latin-1')}"

    def _check_fields(self, fields: dict[str, str]) -> None:
        """Field count and bytes (names and values; interim heads add up) against the caps."""
        if len(fields) + self._repeats > self._max_fields:
            raise ResponseHeadTooLarge(f"more than {self._max_fields} header fields")
        self._field_bytes += sum(map(len, fields)) + sum(map(len, fields.values()))
        if self._field_bytes > self._max_head_bytes:
            raise ResponseHeadTooLarge(self._over_cap())

    def _over_cap(self) -> str:
        what = "response head exceeds" if self.state == HEAD else "trailers exceed"
        return f"{what} {self._max_head_bytes} bytes"

    def _unsolicited(self, nbytes: int) -> None:
        """Bytes nobody asked for: this connection can no longer be trusted to frame answers."""
        if not self.closed:
            log.warning(
                "upstream %s sent %s unsolicited bytes; connection closed, not reused",
                self._label,
                nbytes or "some",
            )
        self.abort()

    def _fail(self, exc: HttpClientError) -> None:
        if self._error is None:
            self._error = exc
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: the awaiting request re-raises it
        self._wake()
        self.abort()

    # -- used by the pool and the response

    def start(self, data: bytes) -> asyncio.Future[None]:
        """Send one request; return a future for its final response head."""
        # Only fresh or reusable connections get here: no chunks, no error, reading on.
        assert self.transport is not None
        self.nothing_received = True
        self.headers = self._filling = {}
        self.trailers = {}  # each response its own: a released Response keeps its dict
        self._repeats = 0
        self._field_bytes = 0
        self._framing_bytes = 0
        self._buffered = 0
        self.state = HEAD
        self._head = self._loop.create_future()
        self.transport.write(data)
        return self._head

    def still_idle(self) -> bool:
        """False (and the connection closed) if bytes or EOF arrived since it went idle.

        Besides what data_received already saw, this polls the socket (plain TCP): the loop
        reads sockets only between steps, so a stray answer that reached the kernel just
        before reuse would otherwise be read as the next request's answer. httpcore checks
        idle sockets for readability the same way before reusing them.
        """
        if self.closed:
            return False
        if self._poll is not None and self._poll.poll(0):
            self._unsolicited(0)
            return False
        return True

    def to_idle(self) -> None:
        """The response was read whole: the connection may carry the next request."""
        self.state = IDLE
        self.idle_since = self._loop.time()

    def _take_buffered(self) -> bytes:
        """Every body byte buffered so far, as one piece; reading resumes if it was paused."""
        chunks = self._chunks
        body = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()
        return body

    async def read_chunk(self) -> bytes:
        """All body bytes received so far (waiting for some); b"" at the end of the body."""
        while True:
            chunks = self._chunks
            if chunks:
                if len(chunks) == 1 and not self._paused:  # a stream's usual read, inline
                    self._buffered = 0
                    return chunks.popleft()
                return self._take_buffered()
            if self._error is not None:
                raise self._error
            if self.state == DONE:
                return b""
            if self.closed:
                raise HttpClientError("connection closed before the body ended")
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_all(self, max_bytes: int | None = None) -> bytes:
        """The whole body, at most ``max_answer_bytes`` (or the smaller ``max_bytes``) of it,
        else ResponseTooLarge: reading stops at the cap and the connection is aborted, so no
        more of an oversized answer is buffered than the flow-control window."""
        limit = (
            self._max_answer_bytes if max_bytes is None else min(max_bytes, self._max_answer_bytes)
        )
        if self.state == DONE and self._error is None:
            # Usually the whole answer arrived with its head: take it without awaiting.
            body = self._take_buffered()
            if len(body) > limit:
                self.abort()
                raise ResponseTooLarge(f"answer exceeds {limit} bytes")
            return body
        parts = []
        total = 0
        while chunk := await self.read_chunk():
            total += len(chunk)
            if total > limit:
                self.abort()
                raise ResponseTooLarge(f"answer exceeds {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def at_eof(self) -> bool:
        return self.state == DONE and not self._chunks

    @property
    def reusable(self) -> bool:
        return self.state == DONE and not self._chunks and self.keep_alive and not self.closed

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
