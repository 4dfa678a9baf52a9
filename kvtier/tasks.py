"""Cancels that must not be lost: stopping background tasks, and calls into clients that eat
a cancel.

``task.cancel()`` followed by ``await task`` under ``suppress(CancelledError)`` swallows two
different cancels alike: the task's (wanted) and one aimed at the caller while it waits (not
wanted: the caller then runs on as if nobody had stopped it, and whoever is waiting for the
caller to end may wait forever — twice a hang in this project's CI). :func:`cancel_and_wait`
tells them apart by the caller's own cancel count.

:class:`CallerCancel` guards a call into a client that may catch a cancel landing inside it and
answer anyway, or fail with an error of its own (redis-py 8.1 on Python 3.11 did, after a paused
Redis resumed: a closing router's heartbeat ran on and its ``close()`` waited forever): after
the call, a rise in the caller's cancel count is raised as the CancelledError it was.

Both are used from coroutines on the event loop that owns the tasks; not from another thread.
A task that ignores its cancel keeps :func:`cancel_and_wait` waiting (as before).
"""

from __future__ import annotations

import asyncio
from typing import Any


class CallerCancel:
    """The calling task's cancel count when this was made (see the module docstring).

    Make one right before the call and :meth:`check` it after the call returned or failed with
    anything but CancelledError. A deadline the caller applies with ``asyncio.timeout`` around
    the call does not count: the timeout takes its own cancel back before :meth:`check`."""

    __slots__ = ("_before", "_task")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self._before = self._task.cancelling() if self._task is not None else 0

    @property
    def lost(self) -> bool:
        """The caller was cancelled since, and no CancelledError reached it yet."""
        return self._task is not None and self._task.cancelling() > self._before

    def check(self, what: str, cause: BaseException | None = None) -> None:
        """Raise CancelledError (from ``cause``, the client's own error if any) if :attr:`lost`."""
        if self.lost:
            raise asyncio.CancelledError(f"{what} cancelled") from cause


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel each task (``None``s are skipped) and wait until all have ended.

    A cancel of the caller that lands meanwhile does not cut the wait short (the caller usually
    closes what the tasks were using next); it is raised once every task has ended. A task that
    ended with an error other than its cancel has that error raised here (the first such), as
    ``await task`` would."""
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    caller_cancelled: asyncio.CancelledError | None = None
    while not all(task.done() for task in pending):
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError as exc:
            caller_cancelled = exc
    failure: BaseException | None = None
    for task in pending:
        if task.cancelled():
            continue
        error = task.exception()  # retrieved either way: no "never retrieved" warning
        if error is not None and failure is None:
            failure = error
    if caller_cancelled is not None:
        raise caller_cancelled
    if failure is not None:
        raise failure
