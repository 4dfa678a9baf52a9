"""A client call that eats a cancel: shared by the tests of every guard against it."""

from __future__ import annotations

import asyncio


class CancelEatingCall:
    """Catches a cancel landing inside it and then answers (``then="answer"``) or fails with a
    connection error of its own (``then="error"``), as redis-py 8.1 on Python 3.11 did after a
    paused Redis resumed."""

    def __init__(self, then: str) -> None:
        self.then = then
        self.entered = asyncio.Event()
        self.ate = 0

    async def __call__(self) -> str:
        self.entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.ate += 1
            if self.then == "error":
                raise ConnectionError("connection reset while reading") from None
        return "answer"
