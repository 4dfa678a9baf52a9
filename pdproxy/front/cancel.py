"""Cancelling a request's in-flight work when its client leaves or its consumer goes quiet.

One :class:`RequestCanceller` per request learns of the client's disconnect and cancels the
request's own task, but only while an *armed* section (an upstream leg, a relay) is running.
Under ``pdproxy serve`` the server calls it through the request's
:class:`~pdproxy.front.request.DisconnectHook` (no task at all); under any other ASGI server it
watches the ``receive`` channel for ``http.disconnect`` with one watcher task per request (no
extra task per leg). :class:`IdleWatchdog` fires the same
canceller when no consumer chunk arrived for ``idle_s``, with one timer per stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.types import Receive

from pdproxy.front.request import DisconnectHook

CLIENT_DISCONNECT = "client_disconnect"
CONSUMER_IDLE = "consumer_idle"


class RequestCanceller:
    __slots__ = ("_armed", "_hook", "_left", "_task", "_watch", "reason")

    def __init__(self, receive: Receive, hook: DisconnectHook | None = None) -> None:
        """``hook``: the server reports the client's disconnect there (no watcher task)."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("RequestCanceller needs a running task")
        self._task = task
        self._armed = False
        self._left = False
        self.reason: str | None = None
        self._hook = hook
        self._watch: asyncio.Task[None] | None = None
        if hook is not None:
            hook.callback = self._client_left
            if hook.lost:  # it left before this canceller existed
                self._client_left()
        else:
            self._watch = asyncio.get_running_loop().create_task(self._listen(receive))

    def _client_left(self) -> None:
        self.fire(CLIENT_DISCONNECT)

    async def _listen(self, receive: Receive) -> None:
        while True:
            message: Any = await receive()
            if message["type"] == "http.disconnect":
                self.fire(CLIENT_DISCONNECT)
                return

    def fire(self, reason: str) -> None:
        if reason == CLIENT_DISCONNECT:
            self._left = True
        if self.reason is None:
            self.reason = reason
        if self._armed:
            self._armed = False
            self._task.cancel()

    @contextmanager
    def armed(self) -> Iterator[None]:
        """Within the block, a disconnect (or idle timeout) cancels the request's task."""
        if self.reason is not None:
            # Fired while disarmed: deliver it now, as if it had landed inside the block.
            raise asyncio.CancelledError(self.reason)
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def rearm(self, reason: str) -> bool:
        """Forget a fired ``reason`` (a stalled consumer being replaced mid-stream) so the
        request can arm again; False, and the reason becomes the client's, if it left."""
        if self._left:
            self.reason = CLIENT_DISCONNECT
            return False
        if self.reason == reason:
            self.reason = None
        return self.reason is None

    def owns(self, exc: asyncio.CancelledError) -> bool:
        """True if ``exc`` is this canceller's doing; then the task's cancel is undone."""
        if self.reason is None:
            return False
        if self._task.cancelling():
            self._task.uncancel()
        return True

    def close(self) -> None:
        self._armed = False
        if self._watch is not None:
            self._watch.cancel()
        if self._hook is not None:
            self._hook.callback = None


class IdleWatchdog:
    """Fires ``canceller`` with :data:`CONSUMER_IDLE` when it was not touched for idle_s.

    Touching is :meth:`touch`, or, on a relay's per-chunk path, setting :attr:`last` to
    :attr:`clock` ``()`` (the same, one Python call fewer per chunk)."""

    __slots__ = ("_canceller", "_handle", "_idle_s", "_loop", "clock", "last")

    def __init__(self, canceller: RequestCanceller, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._canceller = canceller
        self._idle_s = idle_s
        self.clock = self._loop.time
        """The loop's clock, which :attr:`last` is read against."""
        self.last = self._loop.time()
        """When it was last touched (:attr:`clock`'s time)."""
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(
            self.last + idle_s, self._check
        )

    def touch(self) -> None:
        self.last = self._loop.time()

    def _check(self) -> None:
        due = self.last + self._idle_s
        if self._loop.time() >= due:
            self._handle = None
            self._canceller.fire(CONSUMER_IDLE)
        else:
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
