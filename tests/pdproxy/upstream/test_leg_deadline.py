"""LegDeadline: a leg's timeout as one loop timer, with asyncio.timeout's semantics."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdproxy.upstream.client import LegDeadline


async def test_a_deadline_that_fires_is_the_legs_timeout_and_leaves_no_cancel_behind() -> None:
    async def leg() -> str:
        deadline = LegDeadline(0.01)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if deadline.expired():
                return "timed out"
            raise
        finally:
            deadline.cancel()
        return "answered"

    task = asyncio.get_running_loop().create_task(leg())
    assert await task == "timed out"
    assert task.cancelling() == 0


async def test_a_leg_done_in_time_cancels_its_timer() -> None:
    deadline = LegDeadline(0.01)
    deadline.cancel()
    await asyncio.sleep(0.03)
    assert not deadline.fired
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


async def test_a_cancel_from_elsewhere_wins_over_a_deadline_landing_with_it() -> None:
    seen: list[bool] = []

    async def leg() -> None:
        me = asyncio.current_task()
        assert me is not None
        deadline = LegDeadline(0.001)
        asyncio.get_running_loop().call_later(0.001, me.cancel)  # the client leaves
        time.sleep(0.01)  # both timers are due in the same loop step
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(deadline.expired())
            raise
        finally:
            deadline.cancel()

    task = asyncio.get_running_loop().create_task(leg())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False]


async def test_a_cancel_from_elsewhere_alone_is_not_a_timeout() -> None:
    started = asyncio.Event()
    seen: list[bool] = []

    async def leg() -> None:
        deadline = LegDeadline(30)
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append(deadline.expired())
            raise
        finally:
            deadline.cancel()

    task = asyncio.get_running_loop().create_task(leg())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [False]
