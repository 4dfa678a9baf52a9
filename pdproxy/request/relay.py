"""Relaying a consumer's stream to the client, byte for byte, as it arrives.

Committed only after the consumer's headers and first chunk arrived (so a failure before that
can still be retried elsewhere). A failure afterwards ends the stream with an OpenAI-shaped
error event and a clean close. The client leaving or the consumer going quiet for
``consumer_idle_s`` cancels the read at once and closes the upstream connection. The relay only
reports what happened (:class:`StreamEnd`); the request's lease gives everything back. It sees
the lease only as a :class:`StreamLease`: the legs it holds and the backends it suspects.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Protocol

from starlette.datastructures import MutableHeaders
from starlette.types import Send

from pdproxy.errors import LegFailed
from pdproxy.fleet.backends import Backend
from pdproxy.front.cancel import CLIENT_DISCONNECT, IdleWatchdog, RequestCanceller
from pdproxy.front.responses import stream_error_event
from pdproxy.observe.metrics import ProxyMetrics
from pdproxy.request.record import RequestId
from pdproxy.upstream.pool import HttpClientError
from pdproxy.upstream.pool import Response as UpstreamResponse

log = logging.getLogger(__name__)

_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def find_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a consumer body or its last chunks."""
    found = _CACHED_TOKENS.findall(data)
    return int(found[-1]) if found else None


class LegHold(Protocol):
    """One leg on one backend, counted in flight until :meth:`release` (idempotent); the
    lease's :class:`~pdproxy.request.lease.BackendHold`."""

    @property
    def backend(self) -> Backend: ...

    @property
    def open(self) -> bool: ...

    def succeeded(self) -> None: ...

    def refused(self) -> None: ...

    def failed(self, exc: LegFailed) -> None: ...

    def release(self) -> None: ...


class StreamLease(Protocol):
    """What a relay may do with its request's lease (:mod:`pdproxy.request.lease`): hold a
    backend for a new leg (mid-stream failover) and name a backend whose leg failed."""

    @property
    def request_id(self) -> RequestId: ...

    def hold(self, backend: Backend) -> LegHold: ...

    def suspect(self, backend: Backend, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a relayed stream ended."""

    ok: bool
    """The client got the whole answer."""
    consumer: str
    """The consumer that sent its last bytes (after a migration, not the first one)."""
    cached_tokens: int | None
    client_left: bool


class Relay:
    """A committed consumer stream, ready to be sent to the client."""

    __slots__ = (
        "_canceller", "_first", "_hold", "_idle_s", "_lease", "_metrics", "_t0", "_upstream",
        "raw_headers", "status_code",
    )  # fmt: skip

    def __init__(
        self,
        *,
        upstream: UpstreamResponse,
        first: bytes,
        status: int,
        headers: dict[str, str],
        lease: StreamLease,
        hold: LegHold,
        canceller: RequestCanceller,
        metrics: ProxyMetrics,
        idle_s: float,
        t0: float,
    ) -> None:
        self.status_code = status
        self.raw_headers = MutableHeaders(headers).raw
        self._upstream = upstream
        self._first = first
        self._lease = lease
        self._hold = hold
        self._canceller = canceller
        self._metrics = metrics
        self._idle_s = idle_s
        self._t0 = t0

    async def run(self, send: Send) -> StreamEnd:
        """Relay the stream; say how it ended. The consumer's hold is released on the way out,
        whatever happens, and the consumer suspected when its stream failed."""
        hold = self._hold
        ended: str | None = "relay_error"  # what the consumer is suspected of if this raises
        cached_tokens: int | None = None
        failure: str | None = None
        prev = b""
        last = self._first
        watchdog: IdleWatchdog | None = None
        read = self._upstream.chunk_reader()
        canceller = self._canceller
        try:
            try:
                with canceller.armed():
                    await send(
                        {"type": "http.response.start", "status": self.status_code,
                         "headers": self.raw_headers}
                    )  # fmt: skip
                    if last:
                        await send({"type": "http.response.body", "body": last, "more_body": True})
                    watchdog = IdleWatchdog(canceller, self._idle_s)
                    clock = watchdog.clock
                    while True:
                        # The idle clock runs only while we wait on the consumer (touched
                        # without a call: this runs for every chunk).
                        watchdog.last = clock()
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
                log.warning("request %s: consumer stream broke: %r", self._lease.request_id, exc)
                failure = "consumer_stream_broken"
            finally:
                if watchdog is not None:
                    watchdog.cancel()
                if failure is not None or not self._upstream.at_eof:
                    self._upstream.close()
                else:
                    self._upstream.release()
            if failure is None:
                cached_tokens = find_cached_tokens(prev + last)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif failure == CLIENT_DISCONNECT:
                log.info("request %s: client left mid-stream", self._lease.request_id)
            else:
                tail = b"" if last.endswith(b"\n\n") or not last else b"\n\n"
                event = stream_error_event(f"consumer stream ended early: {failure}", failure)
                await send({"type": "http.response.body", "body": tail + event, "more_body": False})
            ended = failure
        finally:
            hold.release()
            backend = hold.backend
            name = backend.name
            self._metrics.observe_leg("consumer", name, time.perf_counter() - self._t0)
            if ended is not None and ended != CLIENT_DISCONNECT:
                self._lease.suspect(backend, ended)
        return StreamEnd(ended is None, name, cached_tokens, ended == CLIENT_DISCONNECT)
