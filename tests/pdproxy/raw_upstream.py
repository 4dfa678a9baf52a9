"""Small raw TCP upstreams on loopback that script every byte they answer (hostile on purpose)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from pdproxy.origin import split_url
from pdproxy.settings import UpstreamSettings
from pdproxy.upstream.pool import HostPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    def __init__(self, handler: Handler, host: str) -> None:
        self._handler = handler
        self.host = host
        self.connections = 0
        self.closed_by_peer = 0
        self.requests: list[bytes] = []
        """Every request head + body the handlers read through :meth:`read_request`."""
        self.server: asyncio.Server | None = None
        self.port = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # The loop is closing under a handler still reading: end quietly (asyncio 3.11's
            # stream callback would log a cancelled handler task as an error).
            pass
        finally:
            if reader.at_eof():
                self.closed_by_peer += 1
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head, body

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@contextlib.asynccontextmanager
async def raw_server(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[RawServer]:
    server = RawServer(handler, host)
    server.server = await asyncio.start_server(server._serve, host, 0)
    server.port = server.server.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        server.server.close()
        await server.server.wait_closed()


def answer(body: bytes, extra: bytes = b"", status: bytes = b"200 OK") -> bytes:
    """A complete, content-length framed HTTP/1.1 response."""
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def pool_for(url: str, **limits: float) -> HostPool:
    origin, _ = split_url(url)
    return HostPool(origin, 1.0, UpstreamSettings(**limits))
