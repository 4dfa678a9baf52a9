"""``asyncio.wait_for`` is not used by the product: on Python 3.11 (the floor) it drops a cancel
that lands in the same loop step as its awaitable completes, so a loop built on it survives
``task.cancel()`` and whoever closes it waits forever (it hung ``KvRouter.close()`` in tests).
``asyncio.timeout`` has no such window."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_product_code_uses_asyncio_timeout_not_wait_for() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for package in ("pdproxy", "kvtier")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "asyncio.wait_for(" in line and not line.lstrip().startswith("#")
    ]
    assert offenders == []


async def _survives_cancel(wait: str) -> bool:
    """A loop waiting on an event, cancelled in the steps right after the event is set."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                if wait == "wait_for":
                    await asyncio.wait_for(event.wait(), 10)
                else:
                    async with asyncio.timeout(10):
                        await event.wait()
            event.clear()
            await asyncio.sleep(0)

    survived = False
    for steps in range(4):
        task = asyncio.create_task(loop())
        for _ in range(3):
            await asyncio.sleep(0)
        event.set()
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=0.5)
        if not done:
            survived = True
            task.cancel()
            await asyncio.wait([task], timeout=0.5)
    return survived


async def test_asyncio_timeout_never_drops_a_cancel() -> None:
    assert not await _survives_cancel("timeout")
