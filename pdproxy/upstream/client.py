"""The upstream client: the two kinds of leg calls and short control calls.

Built on :mod:`pdproxy.upstream.pool` (keep-alive pools per origin over asyncio protocols and
httptools). aiohttp was the first choice and httpx the second; measured here, aiohttp's client
costs ~130-150 us of CPU per request against ~45-60 us for this one, and a PD request makes two.

Every URL becomes a connection and a request target through :func:`pdproxy.origin.split_url`
(legs through :func:`~pdproxy.origin.base_prefix`, its cached form for base URLs), so a
backend's path prefix is kept on legs, health checks, model lists and releases alike.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from pdproxy.errors import LegFailed, LegRefused
from pdproxy.origin import Origin, base_prefix, split_url
from pdproxy.settings import TimeoutSettings, UpstreamSettings
from pdproxy.upstream.pool import HostPool, HttpClientError, Response

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429})


class LegTarget(Protocol):
    """The backend a leg goes to (:class:`pdproxy.fleet.backends.Backend`)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...


def classify_status(backend: str, status: int, body: bytes, content_type: str) -> None:
    """Raise for a non-2xx status: LegFailed when retrying may help, else LegRefused."""
    if status < 400:
        return
    if status >= 500 or status in RETRYABLE_STATUS:
        raise LegFailed(backend, f"status {status}", status=status, body=body)
    raise LegRefused(backend, status, body, content_type)


class LegDeadline:
    """A leg's deadline: one loop timer that cancels the leg's task when it fires.

    What ``asyncio.timeout`` does, without its context manager, its rescheduling and its
    Python calls on every leg (two per request): the caller cancels the timer when the leg is
    done (:meth:`cancel`) and, on ``CancelledError``, asks :meth:`expired` whether the cancel
    was this deadline's. As with ``asyncio.timeout``, a cancel from elsewhere (the client
    leaving) that lands together with the deadline wins: ``expired`` is False then. Made and
    used on the event loop, inside the leg's task."""

    __slots__ = ("_cancelling", "_task", "_timer", "fired")

    def __init__(self, timeout_s: float) -> None:
        task = asyncio.current_task()
        assert task is not None, "a leg runs in a task"
        self._task = task
        self._cancelling = task.cancelling()
        self.fired = False
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self._fire)

    def _fire(self) -> None:
        self.fired = True
        self._task.cancel()

    def expired(self) -> bool:
        """After a ``CancelledError`` in the leg: True when this deadline caused it (its
        cancel is then undone, so the task is not left cancelling)."""
        return self.fired and self._task.uncancel() <= self._cancelling

    def cancel(self) -> None:
        self._timer.cancel()


_PREAMBLE_CAP = 64 * 1024
"""Bytes of chat preamble read at most before a stream is committed regardless."""


def preamble_only(data: bytes) -> bool:
    """The start of a stream holds no output yet: only chat role chunks (a delta with the
    assistant role and empty content, no finish), and maybe half an event after them.

    vLLM sends its role chunk with the first token; other engines (the reference worker,
    SGLang) send it as soon as the request is accepted, before prefill. A leg is committed to
    the client, and its first byte timed, at its first output: a consumer that fails during
    prefill can still be retried, and the TTFT the router learns from is a token's, not the
    role chunk's (a consumer read as prefilling in ~3 ms took every request alone). Anything
    this cannot read as a preamble counts as output."""
    if b'"role"' not in data:  # completions, and chat chunks after the first: one check
        return False
    events = data.split(b"\n\n")
    # The last part is an unfinished event (or b""): not judged until it ends.
    return all(_is_preamble(event) for event in events[:-1])


def _is_preamble(event: bytes) -> bool:
    payload = event.strip()
    if not payload.startswith(b"data:"):
        return False
    try:
        chunk: Any = orjson.loads(payload[5:])
    except orjson.JSONDecodeError:
        return False
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not choices or not isinstance(choices, list):
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if delta.get("content") or any(k not in ("role", "content") for k in delta):
            return False
    return True


@dataclass(slots=True)
class ConsumerOpened:
    """A consumer leg whose headers (and first output, for streams) have arrived."""

    response: Response
    first: bytes
    """The whole body for non-stream legs, else the stream's bytes up to and including its
    first output (:func:`preamble_only`; b"" if the stream ended before any)."""
    complete: bool
    """True when ``first`` is the whole body and the connection is released."""


class Upstream:
    def __init__(self, timeouts: TimeoutSettings, limits: UpstreamSettings) -> None:
        self._timeouts = timeouts
        self._limits = limits
        self._pools: dict[Origin, HostPool] = {}
        self._bases: dict[str, tuple[HostPool, str]] = {}

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._bases.clear()

    def _pool(self, origin: Origin) -> HostPool:
        pool = self._pools.get(origin)
        if pool is None:
            pool = self._pools[origin] = HostPool(origin, self._timeouts.connect_s, self._limits)
        return pool

    def _base(self, base_url: str) -> tuple[HostPool, str]:
        """A backend's pool and path prefix (cached: this is on every leg)."""
        found = self._bases.get(base_url)
        if found is None:
            origin, prefix = base_prefix(base_url)
            found = self._bases[base_url] = (self._pool(origin), prefix)
        return found

    def _target(self, url: str) -> tuple[HostPool, str]:
        origin, target = split_url(url)
        return self._pool(origin), target

    async def producer_leg(
        self, backend: LegTarget, path: str, body: bytes, headers: dict[str, str]
    ) -> bytes:
        """POST the producer leg and return its whole 2xx answer."""
        deadline = LegDeadline(self._timeouts.producer_total_s)
        try:
            pool, prefix = self._base(backend.url)
            resp = await pool.request("POST", prefix + path, headers, body)
            answer = await resp.read()
        except asyncio.CancelledError:
            if deadline.expired():
                raise LegFailed(backend.name, "producer leg timed out", timed_out=True) from None
            raise
        except HttpClientError as exc:
            raise LegFailed(backend.name, f"producer leg failed: {exc}") from exc
        finally:
            deadline.cancel()
        classify_status(backend.name, resp.status, answer, resp.headers.get("content-type", ""))
        return answer

    async def open_consumer_leg(
        self, backend: LegTarget, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> ConsumerOpened:
        """POST the consumer leg; return once it can be committed to the client: a stream at
        its first output (a chat role chunk sent before it is read with it).

        Bounded by the first-byte timeout. Non-2xx answers raise (LegFailed/LegRefused).
        """
        resp: Response | None = None
        deadline = LegDeadline(self._timeouts.consumer_first_byte_s)
        try:
            pool, prefix = self._base(backend.url)
            resp = await pool.request("POST", prefix + path, headers, body)
            if resp.status >= 400 or not stream:
                data = await resp.read()
                classify_status(
                    backend.name, resp.status, data, resp.headers.get("content-type", "")
                )
                return ConsumerOpened(resp, data, complete=True)
            first = await resp.read_chunk()
            while first and len(first) < _PREAMBLE_CAP and preamble_only(first):
                more = await resp.read_chunk()
                if not more:
                    break
                first += more
            return ConsumerOpened(resp, first, complete=False)
        except HttpClientError as exc:
            if resp is not None:
                resp.close()
            raise LegFailed(backend.name, f"consumer leg failed: {exc}") from exc
        except (LegFailed, LegRefused):
            raise
        except BaseException as exc:
            if resp is not None:
                resp.close()
            if isinstance(exc, asyncio.CancelledError) and deadline.expired():
                raise LegFailed(
                    backend.name, "consumer first byte timed out", timed_out=True
                ) from None
            raise
        finally:
            deadline.cancel()

    async def post_json(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """A short control call (P2P release) to ``url``; returns the status."""
        pool, target = self._target(url)
        async with asyncio.timeout(self._timeouts.release_s):
            resp = await pool.request("POST", target, headers, body)
            await resp.read()
        return resp.status

    async def get(
        self, url: str, headers: dict[str, str] | None = None, *, max_bytes: int | None = None
    ) -> tuple[int, bytes]:
        """A short GET (health checks, model lists). An answer over ``max_bytes`` is read no
        further (:class:`~pdproxy.errors.ResponseTooLarge`; its connection is not reused)."""
        pool, target = self._target(url)
        async with asyncio.timeout(self._timeouts.health_check_s):
            resp = await pool.request("GET", target, headers or {})
            return resp.status, await resp.read(max_bytes)
