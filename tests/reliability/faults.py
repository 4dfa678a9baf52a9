"""Fault injection on loopback: a TCP relay that records, delays, stalls or cuts its traffic.

Put a :class:`TcpRelay` between two processes (a consumer and its producer's P2P port, a proxy
and Redis) and point the client at ``relay.port``. It forwards both ways and can

- record what the client sent (to replay it later on a fresh connection),
- call ``on_upstream_bytes(total)`` as the server's bytes flow back (e.g. to SIGKILL the
  server once a transfer is under way),
- add a delay to every chunk (a slow network), stall (accept but forward nothing: a hung peer),
  or refuse (close every new connection at once).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from tests.conftest import free_port

_CHUNK = 64 * 1024


class TcpRelay:
    """An asyncio relay ``127.0.0.1:port`` → ``target_host:target_port``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.delay_s = 0.0
        self.stalled = False
        self.refusing = False
        self.recorded = bytearray()
        self.upstream_bytes = 0
        self.connections = 0
        self.on_upstream_bytes: Callable[[int], None] | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task
        if self._server is not None:
            with contextlib.suppress(OSError):
                await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> TcpRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def cut(self) -> None:
        """Close every open connection (both sides) now."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        up_writer: asyncio.StreamWriter | None = None
        try:
            if self.refusing:
                writer.transport.abort()
                return
            self._writers.add(writer)
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            self._writers.add(up_writer)
            down = asyncio.create_task(self._pump(reader, up_writer, record=True))
            up = asyncio.create_task(self._pump(up_reader, writer, record=False))
            try:
                await asyncio.wait({down, up}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (down, up):
                    t.cancel()
                for t in (down, up):
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await t
        except OSError:
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort()
            self._tasks.discard(task)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, record: bool
    ) -> None:
        while True:
            data = await reader.read(_CHUNK)
            if not data:
                return
            while self.stalled:
                await asyncio.sleep(0.01)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if record:
                self.recorded += data
            writer.write(data)
            await writer.drain()
            if not record:
                self.upstream_bytes += len(data)
                if self.on_upstream_bytes is not None:
                    self.on_upstream_bytes(self.upstream_bytes)


async def replay_bytes(port: int, payload: bytes, read_timeout_s: float = 2.0) -> bytes:
    """Open a fresh connection, send ``payload``, return all the server sends until it closes
    (or stays silent for ``read_timeout_s``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received = bytearray()
    try:
        writer.write(payload)
        await writer.drain()
        while True:
            try:
                data = await asyncio.wait_for(reader.read(_CHUNK), read_timeout_s)
            except TimeoutError:
                break
            if not data:
                break
            received += data
    except OSError:
        pass
    finally:
        writer.transport.abort()
    return bytes(received)
