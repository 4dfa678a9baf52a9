"""Relaying a consumer's stream to the client, byte for byte, as it arrives.

Committed only after the consumer's headers and first chunk arrived (so a failure before that
can still be retried elsewhere). A failure afterwards ends the stream with an OpenAI-shaped
error event and a clean close. The client leaving or the consumer going quiet for
``consumer_idle_s`` cancels the read at once and closes the upstream connection. The relay only
reports what happened; the request's lease (:mod:`pdproxy.request.lease`) gives everything back.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import TYPE_CHECKING

from starlette.datastructures import MutableHeaders
from starlette.types import Send

from pdproxy.front.cancel import CLIENT_DISCONNECT, IdleWatchdog, RequestCanceller
from pdproxy.front.responses import stream_error_event
from pdproxy.upstream.pool import HttpClientError
from pdproxy.upstream.pool import Response as UpstreamResponse

if TYPE_CHECKING:
    from pdproxy.request.lease import BackendHold, RequestLease

log = logging.getLogger(__name__)

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def find_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a consumer body or its last chunks."""
    found = _CACHED_TOKENS.findall(data)
    return int(found[-1]) if found else None


class Relay:
    """A committed consumer stream, ready to be sent to the client."""

    __slots__ = (
        "_canceller", "_first", "_hold", "_idle_s", "_t0", "_upstream", "raw_headers",
        "status_code",
    )  # fmt: skip

    def __init__(
        self,
        *,
        upstream: UpstreamResponse,
        first: bytes,
        status: int,
        headers: dict[str, str],
        hold: BackendHold,
        canceller: RequestCanceller,
        idle_s: float,
        t0: float,
    ) -> None:
        self.status_code = status
        self.raw_headers = MutableHeaders(headers).raw
        self._upstream = upstream
        self._first = first
        self._hold = hold
        self._canceller = canceller
        self._idle_s = idle_s
        self._t0 = t0

    async def run(self, send: Send, lease: RequestLease) -> bool:
        """Relay the stream; True when it ended cleanly."""
        failure: str | None = "relay_error"
        try:
            failure = await self._relay(send, lease)
        finally:
            self._hold.release()
            backend = self._hold.backend.name
            lease.observe_leg("consumer", backend, time.perf_counter() - self._t0)
            if failure == CLIENT_DISCONNECT:
                lease.disconnected()
                log.info("request %s: client left mid-stream", lease.request_id)
            elif failure is not None:
                lease.suspect(self._hold.backend, failure)
        return failure is None

    async def _relay(self, send: Send, lease: RequestLease) -> str | None:
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
            log.warning("request %s: consumer stream broke: %r", lease.request_id, exc)
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
            lease.cached_tokens = find_cached_tokens(prev + last)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return failure
