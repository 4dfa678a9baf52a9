"""``GracefulServer``: uvicorn serving the worker app, stopped in order by SIGTERM/SIGINT.

On the first signal the worker stops admitting requests and gives those in flight
``shutdown_timeout_s`` to finish before aborting them (they answer 503); uvicorn meanwhile stops
accepting connections and waits for the open requests, then the app's lifespan closes the worker
(engine, P2P server and client, supplies, event publisher). uvicorn re-raises a captured signal
once it has shut down, which turns a graceful stop into "killed by SIGTERM" (status -15); this
server does not, so the process exits 0. A second SIGINT still forces the exit, as in uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvtier.worker.ranks import WorkerRanks
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import Worker

_BACKSTOP_S = 2
"""uvicorn cancels request tasks this long after the worker's own drain bound has passed."""


class GracefulServer(uvicorn.Server):
    """uvicorn that drains the worker on SIGTERM/SIGINT and exits with status 0."""

    def __init__(self, config: uvicorn.Config, worker: Worker | WorkerRanks) -> None:
        super().__init__(config)
        self._worker = worker
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, minus re-raising the signal afterwards."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            # A signal handler: hand the drain to the loop rather than touch it from here.
            self._loop.call_soon_threadsafe(self._worker.begin_shutdown)
        super().handle_exit(sig, frame)


def serve_worker(app: FastAPI, settings: WorkerSettings, log_level: str) -> bool:
    """Run ``app`` (from :func:`~kvtier.worker.server.app.create_app`) until a signal stops it;
    True once it started and then stopped (its lifespan closed the worker), False if it never
    started."""
    worker: WorkerRanks = app.state.ranks
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s) + _BACKSTOP_S,
    )
    server = GracefulServer(config, worker)
    server.run()
    return bool(server.started)
