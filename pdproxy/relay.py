"""Relaying a consumer's stream to the client, byte for byte, as it arrives.

Committed only after the consumer's headers and first chunk arrived (so a failure before that
can still be retried elsewhere). A failure afterwards ends the stream with an OpenAI-shaped
error event and a clean close. The client leaving or the consumer going quiet for
``consumer_idle_s`` cancels the read at once and closes the upstream connection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdproxy.cancel import CLIENT_DISCONNECT, IdleWatchdog, RequestCanceller
from pdproxy.exchange import Exchange, find_cached_tokens
from pdproxy.http1 import HttpClientError
from pdproxy.http1 import Response as UpstreamResponse
from pdproxy.http_errors import stream_error_event

log = logging.getLogger(__name__)


class RelayResponse(Response):
    def __init__(
        self,
        *,
        exchange: Exchange,
        upstream: UpstreamResponse,
        first: bytes,
        status: int,
        headers: dict[str, str],
        canceller: RequestCanceller,
        idle_s: float,
        on_end: Callable[[Exchange, str | None], Awaitable[None]],
    ) -> None:
        # No super().__init__: without a body, init_headers adds no content-length.
        self.status_code = status
        self.background = None
        self.init_headers(headers)
        self._exchange = exchange
        self._upstream = upstream
        self._first = first
        self._canceller = canceller
        self._idle_s = idle_s
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failure: str | None = "relay_error"
        try:
            failure = await self._relay(send)
        finally:
            await self._on_end(self._exchange, failure)

    async def _relay(self, send: Send) -> str | None:
        failure: str | None = None
        prev = b""
        last = self._first
        watchdog: IdleWatchdog | None = None
        read = self._upstream.read_chunk
        canceller = self._canceller
        try:
            with canceller.armed():
                await send(
                    {"type": "http.response.start", "status": self.status_code,
                     "headers": self.raw_headers}
                )  # fmt: skip
                if last:
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                watchdog = IdleWatchdog(canceller, self._idle_s)
                touch = watchdog.touch
                while True:
                    touch()  # the idle clock runs only while we wait on the consumer
                    chunk = await read()
                    if not chunk:
                        break
                    prev, last = last, chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError as exc:
            if not canceller.owns(exc):
                raise
            failure = canceller.reason
        except HttpClientError as exc:
            log.warning("request %s: consumer stream broke: %r", self._exchange.request_id, exc)
            failure = "consumer_stream_broken"
        finally:
            if watchdog is not None:
                watchdog.cancel()
            if failure is not None or not self._upstream.at_eof:
                self._upstream.close()
            else:
                self._upstream.release()
        if failure is not None and failure != CLIENT_DISCONNECT:
            tail = b"" if last.endswith(b"\n\n") or not last else b"\n\n"
            event = stream_error_event(f"consumer stream ended early: {failure}", failure)
            await send({"type": "http.response.body", "body": tail + event, "more_body": False})
        elif failure is None:
            self._exchange.cached_tokens = find_cached_tokens(prev + last)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return failure
