"""Admission control: at most ``max_concurrent`` requests run, a bounded FIFO queue waits.

A full queue or a wait past ``queue_timeout_s`` is refused with :class:`Overloaded` (429 with
``Retry-After``). Slots are handed directly from a finishing request to the oldest waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque

from pdproxy.errors import Overloaded
from pdproxy.settings import AdmissionSettings


class Admission:
    def __init__(self, settings: AdmissionSettings) -> None:
        self._settings = settings
        self._active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._retry_after = max(1, math.ceil(settings.queue_timeout_s / 2))

    @property
    def active(self) -> int:
        return self._active

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take a free slot now if there is one (no queue ahead)."""
        if self._active < self._settings.max_concurrent and not self._waiters:
            self._active += 1
            return True
        return False

    async def acquire(self) -> bool:
        """Take a slot; True when the request had to wait in the queue for it."""
        if self.try_acquire():
            return False
        if len(self._waiters) >= self._settings.queue_size:
            raise Overloaded("too many requests in flight; queue is full", self._retry_after)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._settings.queue_timeout_s):
                await waiter
        except TimeoutError as exc:
            if waiter.done() and not waiter.cancelled():
                return True  # the slot arrived as the timer fired: keep it
            raise Overloaded("timed out waiting for a free slot", self._retry_after) from exc
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # got the slot but we are leaving: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return True

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; _active unchanged
                return
        self._active -= 1
