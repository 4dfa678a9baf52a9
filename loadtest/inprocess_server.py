"""An ASGI app served by uvicorn inside the caller's event loop, on a free loopback port, for
the length of an ``async with`` block (the in-process clusters of tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from pdproxy.stack.ports import free_port


class _InProcessServer(uvicorn.Server):
    """uvicorn in the caller's loop, leaving the process's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` (lifespan on) until the block ends; yields its URL."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="none", access_log=False, log_level="warning",
        lifespan="on",
    )  # fmt: skip
    server = _InProcessServer(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        for _ in range(1000):
            if server.started:
                break
            if task.done():
                task.result()
                raise RuntimeError("server exited before it started")
            await asyncio.sleep(0.01)
        else:
            raise RuntimeError("server did not start in 10 s")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 15)
