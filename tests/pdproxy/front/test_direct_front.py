"""``pdproxy serve``'s direct hot routes (:mod:`pdproxy.front.direct`) against the ASGI path.

Two apps with the same settings and the same fake engines, each under a real uvicorn server with
``pdproxy serve``'s gated protocol: one answers the hot routes directly (``hot=``), the other
through ASGI (``ProxyApp.__call__``, as under any other server). The same raw requests go to
both over raw sockets; what a client can observe must be the same: status, headers (the
``date`` aside) and bodies, byte for byte (streams compared de-chunked: how chunks coalesce
depends on reads), the connection left open or closed, and what the proxy counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import uvicorn

from loadtest.fake_backend import FakeBackend
from pdproxy.app import ProxyState, create_app, proxy_state
from pdproxy.front.protocol import gated_protocol
from tests.conftest import free_port
from tests.pdproxy.conftest import FakeFactory, backend_entry, eventually, quick_settings

KEY = "sk-direct-test"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the test's process keeps its own signal handlers


@dataclass
class Served:
    port: int
    state: ProxyState
    server: uvicorn.Server


@contextlib.asynccontextmanager
async def _serve(settings: Any, *, direct: bool) -> AsyncIterator[Served]:
    app = create_app(settings)
    state = proxy_state(app)
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="none", lifespan="on", log_level="warning",
        access_log=False, proxy_headers=False, server_header=False,
        http=gated_protocol(state.connections, hot=state.request_path if direct else None),
    )  # fmt: skip
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield Served(port, state, server)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def _both(settings: Any) -> AsyncIterator[tuple[Served, Served]]:
    async with _serve(settings, direct=False) as asgi, _serve(settings, direct=True) as direct:
        yield asgi, direct


@dataclass
class Answer:
    head: bytes
    """Status line and headers, ``date`` normalised."""
    body: bytes
    """De-chunked when chunked."""
    chunked: bool


_DATE = re.compile(rb"\r\ndate: [^\r]*")
_VOLATILE = re.compile(rb'(cmpl-|chatcmpl-)[0-9A-Za-z-]+|"created":\s*\d+')


def _normal(data: bytes) -> bytes:
    return _VOLATILE.sub(lambda m: m.group(1) or b'"created":0', _DATE.sub(b"\r\ndate: -", data))


async def _read_answer(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> Answer:
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                chunk = await reader.readexactly(size + 2)
                assert chunk.endswith(b"\r\n")
                if size == 0:
                    return Answer(_normal(head), _normal(body), True)
                body += chunk[:-2]
        match = re.search(rb"content-length: (\d+)", lower)
        length = int(match.group(1)) if match else 0
        return Answer(_normal(head), _normal(await reader.readexactly(length)), False)


async def _closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bool:
    """The server closed the connection (EOF) within ``timeout_s``."""
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(timeout_s):
            return await reader.read(1) == b""
    return False


async def _exchange(port: int, *raw: bytes, answers: int = 1) -> list[Answer]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for part in raw:
            writer.write(part)
        await writer.drain()
        return [await _read_answer(reader) for _ in range(answers)]
    finally:
        writer.close()


def _post(path: str, body: bytes, *, key: str | None = KEY, extra: bytes = b"") -> bytes:
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    return (
        b"POST %s HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
        b"x-request-id: client-1\r\n%s%scontent-length: %d\r\n\r\n%s"
        % (path.encode(), auth, extra, len(body), body)
    )


def _settings(d: FakeBackend, p: FakeBackend, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "api_keys": [{"key": KEY}],
        "server_timing": False,
        "admission": {"max_body_bytes": 4096, "body_read_timeout_s": 0.5},
    }
    values.update(overrides)
    return quick_settings([backend_entry(p, "producer"), backend_entry(d, "consumer")], **values)


def _counted(state: ProxyState, name: str, **labels: str) -> float:
    return state.metrics.registry.get_sample_value(name, labels) or 0.0


def _requests(state: ProxyState) -> dict[tuple[tuple[str, str], ...], float]:
    """``pdproxy_requests_total``'s samples, by labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for metric in state.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "pdproxy_requests_total"
    }


_COMPLETION = orjson.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": 4})
_CHAT_STREAM = orjson.dumps(
    {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
)
_REQUESTS = {
    "completion": _post("/v1/completions", _COMPLETION),
    "chat stream": _post("/v1/chat/completions", _CHAT_STREAM),
    "400 not json": _post("/v1/completions", b"{nope"),
    "400 not an object": _post("/v1/chat/completions", b"[1]"),
    "401 no key": _post("/v1/completions", _COMPLETION, key=None),
    "401 wrong key": _post("/v1/completions", _COMPLETION, key="sk-wrong"),
    "413 declared": _post("/v1/completions", b"x" * 5000),
    "413 chunked": (
        b"POST /v1/completions HTTP/1.1\r\nhost: p\r\nx-request-id: c\r\n"
        b"authorization: Bearer %s\r\n"
        b"transfer-encoding: chunked\r\n\r\n1388\r\n%s\r\n0\r\n\r\n" % (KEY.encode(), b"x" * 5000)
    ),
    "http/1.0": _post("/v1/completions", _COMPLETION).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    "connection close": _post("/v1/completions", _COMPLETION, extra=b"connection: close\r\n"),
    "query string (asgi route)": _post("/v1/completions?x=1", _COMPLETION),
}


async def test_the_same_requests_get_the_same_answers(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D", chunks=6)
    async with _both(_settings(d, p)) as (asgi, direct):
        for name, raw in _REQUESTS.items():
            got = [await _exchange(s.port, raw) for s in (asgi, direct)]
            assert got[0] == got[1], name
            assert got[0][0].head.split(b" ")[1] == {
                "completion": b"200", "chat stream": b"200", "http/1.0": b"200",
                "connection close": b"200", "query string (asgi route)": b"200",
            }.get(name, name[:3].encode()), (name, got[0][0].head)  # fmt: skip
        assert _requests(direct.state) == _requests(asgi.state)
        assert sum(_requests(direct.state).values()) == len(_REQUESTS)
        for s in (asgi, direct):
            assert all(b.in_flight == 0 for b in s.state.registry.all())


async def test_keep_alive_pipelining_and_close_are_the_same(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D", chunks=3)
    stream = _post("/v1/chat/completions", _CHAT_STREAM)
    plain = _post("/v1/completions", _COMPLETION)
    refused = _post("/v1/completions", _COMPLETION, key=None)
    async with _both(_settings(d, p)) as (asgi, direct):
        seen = []
        for s in (asgi, direct):
            # Pipelined: three requests in one write, answered in order on one connection.
            answers = await _exchange(s.port, plain + stream + refused, answers=3)
            assert [a.head.split(b" ")[1] for a in answers] == [b"200", b"200", b"401"]
            assert [a.chunked for a in answers] == [False, True, False]
            seen.append(answers)
            # The connection stays open after a keep-alive answer, closes after HTTP/1.0.
            for raw, stays in ((plain, True), (plain.replace(b"HTTP/1.1", b"HTTP/1.0", 1), False)):
                reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
                writer.write(raw)
                await _read_answer(reader)
                assert await _closed(reader, 0.3 if stays else 5.0) is not stays
                writer.close()
        assert seen[0] == seen[1]


async def test_100_continue_is_sent_once_the_body_is_wanted(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D")
    raw = _post("/v1/completions", _COMPLETION, extra=b"expect: 100-continue\r\n")
    head, body = raw.split(b"\r\n\r\n", 1)
    async with _both(_settings(d, p)) as (asgi, direct):
        got = []
        for s in (asgi, direct):
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(head + b"\r\n\r\n")
            async with asyncio.timeout(5):
                assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(body)
            got.append(await _read_answer(reader))
            writer.close()
            # A refused key: no 100 Continue, the refusal at once (nothing read).
            refused = _post(
                "/v1/completions", _COMPLETION, key=None, extra=b"expect: 100-continue\r\n"
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(refused.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n")
            got.append(await _read_answer(reader))
            writer.close()
        assert got[0] == got[2] and got[1] == got[3]
        assert got[0].head.startswith(b"HTTP/1.1 200") and got[1].head.startswith(b"HTTP/1.1 401")


async def test_a_slow_body_gets_408_at_its_deadline(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D")
    raw = _post("/v1/completions", _COMPLETION)
    async with _both(_settings(d, p)) as (asgi, direct):
        got = []
        for s in (asgi, direct):
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(raw[:-10])  # the last 10 bytes never come
            got.append(await _read_answer(reader))
            writer.close()
            await eventually(lambda s=s: _counted(s.state, "pdproxy_body_read_timeouts_total") == 1)
        assert got[0] == got[1] and got[0].head.startswith(b"HTTP/1.1 408")


async def test_429_and_503_and_a_client_leaving_while_served(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D", hang=True)
    settings = _settings(d, p, admission={"max_concurrent": 1, "queue_size": 0})
    raw = _post("/v1/completions", _COMPLETION)
    async with _both(settings) as (asgi, direct):
        got = []
        for s in (asgi, direct):
            _, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(raw)  # takes the one slot; its consumer never answers
            await eventually(lambda s=s: any(b.in_flight for b in s.state.registry.all()))
            got.append((await _exchange(s.port, raw))[0])  # no slot, no queue
            writer.close()  # the first client leaves: its legs are cancelled, all given back
            await eventually(lambda s=s: all(b.in_flight == 0 for b in s.state.registry.all()))
            await eventually(
                lambda s=s: (
                    _counted(s.state, "pdproxy_disconnect_aborts_total", stage="consumer") == 1
                )
            )
        assert got[0] == got[1] and got[0].head.startswith(b"HTTP/1.1 429")
    alone = quick_settings([backend_entry(p, "producer")], server_timing=False)
    async with _both(alone) as (asgi, direct):
        raw = _post("/v1/completions", _COMPLETION)
        got = [(await _exchange(s.port, raw))[0] for s in (asgi, direct)]
        assert got[0] == got[1] and got[0].head.startswith(b"HTTP/1.1 503")
        assert b"no_backend_available" in got[0].body


async def test_a_client_leaving_mid_stream_cancels_it(fake: FakeFactory) -> None:
    p, d = await fake("P"), await fake("D", chunks=200, chunk_delay_s=0.02)
    raw = _post("/v1/chat/completions", _CHAT_STREAM)
    async with _both(_settings(d, p)) as (asgi, direct):
        for s in (asgi, direct):
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            writer.write(raw)
            async with asyncio.timeout(10):
                await reader.readuntil(b"\r\n\r\n")
                await reader.readuntil(b"data: ")  # the stream has begun
            writer.close()
            await eventually(
                lambda s=s: (
                    _counted(s.state, "pdproxy_disconnect_aborts_total", stage="stream") == 1
                )
            )
            await eventually(lambda s=s: all(b.in_flight == 0 for b in s.state.registry.all()))
        assert d.aborts == 2  # each proxy closed its consumer leg at once


@pytest.mark.parametrize("direct", [False, True])
async def test_a_reader_that_stops_reading_pauses_the_answer(
    fake: FakeFactory, direct: bool
) -> None:
    """Flow control: a client that stops reading a long stream leaves at most the transport's
    high-water mark buffered in the proxy (the relay waits), however much the engine sends."""
    p, d = await fake("P"), await fake("D", chunks=400_000)
    raw = _post("/v1/chat/completions", _CHAT_STREAM)
    async with _serve(_settings(d, p), direct=direct) as s:
        reader, writer = await asyncio.open_connection("127.0.0.1", s.port, limit=2**16)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer.write(raw)
        async with asyncio.timeout(10):
            await reader.readuntil(b"data: ")
        # The client reads no more: the proxy's writes pause (bounded wait).
        conns = s.server.server_state.connections
        await eventually(lambda: any(c.flow.write_paused for c in conns), timeout=20)
        buffered = [c.transport.get_write_buffer_size() for c in conns]
        await asyncio.sleep(0.5)  # the engine keeps sending meanwhile
        assert max(c.transport.get_write_buffer_size() for c in conns) <= max(buffered) + 2**16
        assert max(buffered) <= 2**20
        writer.close()
        await eventually(lambda: all(b.in_flight == 0 for b in s.state.registry.all()), 10)


async def test_a_queued_request_is_served_once_admitted(fake: FakeFactory) -> None:
    """A request that waits for a slot listens to its client meanwhile (its body is read through
    ``receive``): once admitted it is served whole, as through ASGI."""
    p, d = await fake("P"), await fake("D", first_chunk_delay_s=0.3)
    settings = _settings(d, p, admission={"max_concurrent": 1, "queue_size": 4})
    raw = _post("/v1/completions", _COMPLETION)
    async with _both(settings) as (asgi, direct):
        got = []
        for s in (asgi, direct):
            answers = await asyncio.gather(*(_exchange(s.port, raw) for _ in range(3)))
            got.append([a[0] for a in answers])
            assert sum(_requests(s.state).values()) == 3
        assert got[0] == got[1]
        assert all(a.head.startswith(b"HTTP/1.1 200") for a in got[0])
