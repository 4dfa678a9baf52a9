"""The worker's network thread: one asyncio loop that runs kvtier's P2P server and client.

vLLM calls the worker-side connector from its engine thread, synchronously, between forward
passes; kvtier's transport is asyncio. This thread owns the loop: the engine thread hands it
coroutines (:meth:`NetworkThread.submit`) and polls their futures, never blocking on them except
at start-up and shutdown (bounded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NetworkThread:
    """A daemon thread running one event loop until :meth:`stop`."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (from any thread); its result arrives in the future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout_s`` (start-up, shutdown
        and the task gauge only: never on a request's path). Not from the loop's own thread."""
        return self.submit(coro).result(timeout_s)

    def tasks(self) -> int:
        """Tasks alive on the loop right now (a leak gauge); -1 when the loop is too busy to
        answer within 0.2 s (the engine thread asks, and must not stall)."""
        if not self._started or self._loop.is_closed():
            return 0

        async def count() -> int:
            return len(asyncio.all_tasks()) - 1  # minus this one

        try:
            return self.run(count(), 0.2)
        except (concurrent.futures.TimeoutError, RuntimeError):
            return -1

    def stop(self, timeout_s: float) -> None:
        """Cancel what is left, stop the loop and join the thread (bounded by ``timeout_s``)."""
        if not self._started or self._loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout_s)
        except (concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("kvtier network thread: tasks not cancelled in time: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
