"""Connections waiting for a request head: the gate's budgets and deadline, and the protocol
that passes each connection through it (issue 30 finding 1).

The gate is driven with fake connections; the protocol with a real in-process uvicorn server
(the class ``pdproxy serve`` uses) and raw client sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from loadtest.fake_backend import FakeBackend
from pdproxy.app import create_app, proxy_state
from pdproxy.front.connections import ConnectionGate
from pdproxy.front.protocol import gated_protocol
from pdproxy.settings import AdmissionSettings
from tests.conftest import free_port
from tests.pdproxy.conftest import FakeFactory, backend_entry, quick_settings


class _Conn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.expired = 0

    def expire(self) -> None:
        self.expired += 1

    def __repr__(self) -> str:
        return self.name


def _gate(**admission: Any) -> ConnectionGate:
    return ConnectionGate(AdmissionSettings(**admission))


async def test_a_source_over_its_budget_closes_its_own_oldest() -> None:
    gate = _gate(max_waiting_connections=100, max_waiting_per_source=3)
    attacker = [_Conn(f"a{i}") for i in range(5)]
    client = _Conn("client")
    gate.wait(client, "10.0.0.1")
    for conn in attacker:
        gate.wait(conn, "10.0.0.2")
    assert [c.expired for c in attacker] == [1, 1, 0, 0, 0]
    assert client.expired == 0
    assert gate.waiting == 4 and gate.closed["source_budget"] == 2


async def test_over_the_budget_the_oldest_waiting_connection_is_closed() -> None:
    gate = _gate(max_waiting_connections=3, max_waiting_per_source=0)
    conns = [_Conn(f"c{i}") for i in range(5)]
    for i, conn in enumerate(conns):
        gate.wait(conn, f"10.0.0.{i}")
    assert [c.expired for c in conns] == [1, 1, 0, 0, 0]
    gate.done(conns[3])  # it sent its head
    newer = _Conn("newer")
    gate.wait(newer, None)
    assert gate.waiting == 3 and conns[2].expired == 0
    assert gate.closed["waiting_budget"] == 2


async def test_a_connection_still_waiting_at_its_deadline_is_closed() -> None:
    gate = _gate(head_timeout_s=0.05)
    late, headed = _Conn("late"), _Conn("headed")
    gate.wait(late, "10.0.0.1")
    gate.wait(headed, "10.0.0.1")
    gate.done(headed)
    for _ in range(100):  # bounded: 1 s
        if late.expired:
            break
        await asyncio.sleep(0.01)
    assert (late.expired, headed.expired) == (1, 0)
    assert gate.waiting == 0 and gate.closed["head_timeout"] == 1


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the test's process keeps its own signal handlers


@contextlib.asynccontextmanager
async def _served(d: FakeBackend, **admission: Any) -> AsyncIterator[int]:
    """The app under uvicorn with ``pdproxy serve``'s protocol, in this event loop."""
    settings = quick_settings([backend_entry(d, "consumer")], admission=admission)
    app = create_app(settings)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="none", lifespan="on", log_level="warning",
        http=gated_protocol(proxy_state(app).connections),
    )  # fmt: skip
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


async def _answer(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    got = b""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            while chunk := await reader.read(65536):
                got += chunk
    return got


_COMPLETION = (
    b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
    b'content-length: 15\r\n\r\n{"prompt": "x"}'
)


async def test_a_dribbled_head_gets_408_and_an_idle_keep_alive_is_closed(
    fake: FakeFactory,
) -> None:
    d = await fake("D")
    async with _served(d, head_timeout_s=0.3) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: p\r\nx-a: ")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 408")
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_COMPLETION)
        writer.write(_COMPLETION)  # pipelined: both answered, then idle until the deadline
        got = await _answer(reader)
        writer.close()
    # The status lines, not the bytes "408" (a random request id or timestamp may hold them).
    assert got.count(b"HTTP/1.1 200") == 2 and b"HTTP/1.1 408" not in got


async def test_an_endless_head_gets_431(fake: FakeFactory) -> None:
    d = await fake("D")
    async with _served(d, max_head_bytes=4096) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: p\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(64):
                writer.write(b"x-pad: " + b"a" * 1017 + b"\r\n")
                await writer.drain()
        assert (await _answer(reader)).startswith(b"HTTP/1.1 431")
        writer.close()
        # A head under the cap (a 3 KiB header) is served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nhost: p\r\nconnection: close\r\nx-pad: ")
        writer.write(b"a" * 3000 + b"\r\n\r\n")
        assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_the_cap_counts_requests_in_progress_not_sockets(fake: FakeFactory) -> None:
    d = await fake("D", hang=True)
    async with _served(d, max_connections=2) as port:
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(16)]
        health = await asyncio.open_connection("127.0.0.1", port)
        health[1].write(b"GET /health HTTP/1.1\r\nhost: p\r\nconnection: close\r\n\r\n")
        assert (await _answer(health[0])).startswith(b"HTTP/1.1 200")  # silent ones don't count
        busy = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _, writer in busy:
            writer.write(_COMPLETION)  # the consumer hangs: two requests in progress
        await asyncio.sleep(0.2)
        third = await asyncio.open_connection("127.0.0.1", port)
        third[1].write(b"GET /health HTTP/1.1\r\nhost: p\r\n\r\n")
        assert (await _answer(third[0])).startswith(b"HTTP/1.1 503")
        for _, writer in (*idle, *busy, health, third):
            writer.transport.abort()
