"""A consumer stream is committed at its first output, not at a chat role chunk sent before it."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdproxy.settings import TimeoutSettings, UpstreamSettings
from pdproxy.upstream.client import Upstream, preamble_only


def _event(chunk: object) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


ROLE = _event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]})  # fmt: skip
TOKEN = _event({"id": "x", "choices": [{"index": 0, "delta": {"content": "Hi"},
                                        "finish_reason": None}]})  # fmt: skip


CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def test_a_role_chunk_alone_is_a_preamble() -> None:
    assert preamble_only(ROLE)
    assert preamble_only(ROLE + TOKEN[:20])  # half an event after it: not judged yet


@pytest.mark.parametrize(
    "data",
    [
        TOKEN,
        ROLE + TOKEN,
        _event({"choices": [{"text": "a", "index": 0, "finish_reason": None}]}),  # completions
        _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}),
        _event({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": []}}]}),
        _event(
            {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": "length"}]}
        ),
        _event({"error": {"message": "boom", "role": "x"}}),
        b'data: {"role": not json\n\n',
        b": comment role\n\n",
        b"data: [DONE]\n\n",
    ],
)
def test_anything_else_is_output(data: bytes) -> None:
    assert not preamble_only(data)


@given(st.binary(max_size=300))
def test_never_raises(data: bytes) -> None:
    preamble_only(data)
    preamble_only(b'"role"' + data)


async def _serve_stream(chunks: list[tuple[float, bytes]]) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        for delay, data in chunks:
            await asyncio.sleep(delay)
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


class _Backend:
    def __init__(self, url: str) -> None:
        self.name = "c0"
        self.url = url


async def test_the_leg_opens_at_the_first_token_with_the_role_chunk_before_it() -> None:
    """The role chunk at once, the token 0.3 s later (prefill): the leg opens with both, after
    the token, so its first byte is timed at the first token."""
    server, url = await _serve_stream([(0.0, ROLE), (0.3, TOKEN), (0.0, b"data: [DONE]\n\n")])
    upstream = Upstream(TimeoutSettings(), UpstreamSettings())
    try:
        t0 = time.perf_counter()
        opened = await upstream.open_consumer_leg(_Backend(url), CHAT, b"{}", JSON, True)
        waited = time.perf_counter() - t0
        assert opened.first.startswith(ROLE + TOKEN)
        assert waited >= 0.25
        rest = b""
        while chunk := await opened.response.read_chunk():
            rest += chunk
        assert opened.first + rest == ROLE + TOKEN + b"data: [DONE]\n\n"
        opened.response.close()
    finally:
        await upstream.close()
        server.close()
        await server.wait_closed()


async def test_a_stream_that_ends_after_its_role_chunk_opens_with_what_came() -> None:
    server, url = await _serve_stream([(0.0, ROLE)])
    upstream = Upstream(TimeoutSettings(), UpstreamSettings())
    try:
        opened = await upstream.open_consumer_leg(_Backend(url), CHAT, b"{}", JSON, True)
        assert opened.first == ROLE
        opened.response.close()
    finally:
        await upstream.close()
        server.close()
        await server.wait_closed()
