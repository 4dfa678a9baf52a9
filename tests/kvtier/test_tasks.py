"""cancel_and_wait: the stopped tasks' cancels are absorbed, the caller's own is not; a cancel a
client ate inside a call (CallerCancel, used by the Redis boundary) is raised again."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.errors import ResidencyUnavailable
from kvtier.residency.redis_client import bounded
from kvtier.tasks import CallerCancel, cancel_and_wait
from tests.cancel_eating import CancelEatingCall


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


@pytest.mark.parametrize("then", ["answer", "error"])
async def test_a_cancel_the_redis_client_eats_still_cancels_the_caller(then: str) -> None:
    client = CancelEatingCall(then)
    caller = asyncio.create_task(bounded("lease", 5.0, client))
    await client.entered.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert client.ate == 1


async def test_the_deadline_a_redis_client_eats_stays_a_failure_or_an_answer() -> None:
    """bounded's own deadline is not the caller's cancel: an error stays a store failure."""
    with pytest.raises(ResidencyUnavailable):
        await bounded("lease", 0.05, CancelEatingCall("error"))
    assert await bounded("lease", 0.05, CancelEatingCall("answer")) == "answer"


async def test_a_call_nobody_cancelled_passes_the_check() -> None:
    watch = CallerCancel()
    assert not watch.lost
    watch.check("nothing")  # no cancel: no-op
