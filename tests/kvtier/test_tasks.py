"""cancel_and_wait: the stopped tasks' cancels are absorbed, the caller's own is not."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.tasks import cancel_and_wait


async def _forever() -> None:
    await asyncio.sleep(3600)


async def _slow_to_stop(stopping: asyncio.Event, release: asyncio.Event) -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        stopping.set()
        await release.wait()  # cleanup that takes a while


async def test_tasks_are_cancelled_and_awaited() -> None:
    tasks = [asyncio.create_task(_forever()) for _ in range(3)]
    await cancel_and_wait(*tasks, None)
    assert all(t.cancelled() for t in tasks)


async def test_a_cancel_of_the_caller_is_raised_after_the_tasks_ended() -> None:
    """The pattern it replaces (``await task`` under ``suppress(CancelledError)``) returned
    normally here, and the cancelled closer ran on."""
    stopping, release = asyncio.Event(), asyncio.Event()
    worker = asyncio.create_task(_slow_to_stop(stopping, release))
    await asyncio.sleep(0)
    after_wait: list[str] = []

    async def closer() -> None:
        await cancel_and_wait(worker)
        after_wait.append("ran on")  # must not happen: the closer was cancelled

    closing = asyncio.create_task(closer())
    await stopping.wait()
    closing.cancel()
    await asyncio.sleep(0.01)
    assert not closing.done()  # still waiting: the worker has not ended yet
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert worker.done() and after_wait == []


async def test_a_task_that_failed_has_its_error_raised() -> None:
    async def broken() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken"):
        await cancel_and_wait(task, asyncio.create_task(_forever()))
