"""Stopping background tasks without losing a cancel aimed at whoever stops them.

``task.cancel()`` followed by ``await task`` under ``suppress(CancelledError)`` swallows two
different cancels alike: the task's (wanted) and one aimed at the caller while it waits (not
wanted: the caller then runs on as if nobody had stopped it, and whoever is waiting for the
caller to end may wait forever — twice a hang in this project's CI). :func:`cancel_and_wait`
tells them apart by the caller's own cancel count.

Called from ``close()``/``stop()`` coroutines on the event loop that owns the tasks; it may not
be called from another thread. A task that ignores its cancel keeps it waiting (as before).
"""

from __future__ import annotations

import asyncio
from typing import Any


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
