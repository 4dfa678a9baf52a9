"""Two clients, one hostile backend, the proxy app between: no byte of A's answer reaches B.

The backend is a raw TCP server that frames its answers the way the attack needs: interim
``103 Early Hints`` before every answer (the proxy once took the 103 as the answer and handed
the real one to the next client on that connection), or an unsolicited extra answer on the
idle keep-alive connection (once prepended to the next client's answer).

Bytes that arrive after the proxy wrote the next request are, by HTTP/1.1's own rules, that
request's answer (no client can tell them apart); the stray tests therefore send the next
request only once the stray bytes are on the wire, which is the case the proxy must handle.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson

from tests.pdproxy.conftest import ProxyFactory, quick_settings
from tests.pdproxy.raw_upstream import RawServer, answer, raw_server


def _completion(prompt: str) -> bytes:
    return orjson.dumps(
        {"id": "cmpl", "object": "text_completion", "choices": [{"index": 0, "text": prompt}]}
    )


def _stream(prompt: str) -> bytes:
    event = orjson.dumps({"choices": [{"index": 0, "text": prompt}]})
    chunks = [b"data: " + event + b"\n\n", b"data: [DONE]\n\n"]
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


async def _answer_each(
    srv: RawServer,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    interim: bytes = b"",
    stray: bytes = b"",
    piggyback: bytes = b"",
    strays_sent: asyncio.Event | None = None,
) -> None:
    """Answer every request with its own prompt (``answer-for-<prompt>``)."""
    while True:
        _, body = await srv.read_request(reader)
        request = orjson.loads(body)
        text = f"answer-for-{request['prompt']}"
        if interim:
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.005)
        if request.get("stream"):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + _stream(text) + piggyback
            )
        else:
            json = b"content-type: application/json\r\n"
            writer.write(answer(_completion(text), json) + piggyback)  # one write, one packet
        await writer.drain()
        if stray:
            await asyncio.sleep(0.01)  # the proxy has pooled the connection by now
            writer.write(stray)
            await writer.drain()
            if strays_sent is not None:
                strays_sent.set()


def _settings(url: str) -> object:
    return quick_settings(
        [{"name": "engine", "url": url, "role": "consumer", "dialect": "none"}],
        retries={"consumer_attempts": 1, "backoff_base_s": 0.001, "backoff_max_s": 0.005},
    )


async def _two_clients(
    base: str, rounds: int, strays_sent: asyncio.Event | None = None
) -> list[tuple[str, bytes]]:
    """Client A then client B, ``rounds`` times, streamed and not; (prompt, raw answer)."""
    got: list[tuple[str, bytes]] = []
    async with (
        httpx.AsyncClient(base_url=base, timeout=10) as a,
        httpx.AsyncClient(base_url=base, timeout=10) as b,
    ):
        for i in range(rounds):
            for client, who in ((a, "A"), (b, "B")):
                prompt = f"{who}-secret-{i}"
                body = {"model": "m", "prompt": prompt, "stream": i % 2 == 1}
                r = await client.post("/v1/completions", json=body)
                got.append((prompt, r.content))
                assert r.status_code == 200, r.content
                if strays_sent is not None:
                    await asyncio.wait_for(strays_sent.wait(), 5)
                    strays_sent.clear()
                    await asyncio.sleep(0.02)  # the stray bytes reach the proxy's socket
    return got


def _assert_own_answers(got: list[tuple[str, bytes]]) -> None:
    prompts = [p for p, _ in got]
    for prompt, raw in got:
        assert f"answer-for-{prompt}".encode() in raw, (prompt, raw)
        for other in prompts:
            if other != prompt:
                assert other.encode() not in raw, (prompt, other, raw)
        assert b"INJECTED" not in raw


async def test_interim_103_never_hands_one_clients_answer_to_another(
    proxy: ProxyFactory,
) -> None:
    interim = b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(srv, reader, writer, interim=interim)

    async with raw_server(handler) as srv:
        px = await proxy(_settings(srv.url))
        got = await _two_clients(px.url, rounds=4)
    _assert_own_answers(got)
    assert srv.connections == 1  # interim answers are legal: the connection stays pooled


async def test_unsolicited_bytes_on_an_idle_connection_never_reach_the_next_client(
    proxy: ProxyFactory,
) -> None:
    stray = answer(_completion("INJECTED-stray"), b"content-type: application/json\r\n")
    sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(srv, reader, writer, stray=stray, strays_sent=sent)

    async with raw_server(handler) as srv:
        px = await proxy(_settings(srv.url))
        got = await _two_clients(px.url, rounds=3, strays_sent=sent)
    _assert_own_answers(got)
    assert srv.connections == len(got)  # each poisoned connection was dropped


async def test_interim_and_piggybacked_answers_under_concurrency(proxy: ProxyFactory) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nx: 1\r\n\r\n"
    extra = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nINJECTED"

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _answer_each(srv, reader, writer, interim=interim, piggyback=extra)

    async with raw_server(handler) as srv:
        px = await proxy(_settings(srv.url))
        async with httpx.AsyncClient(base_url=px.url, timeout=10) as client:

            async def one(i: int) -> tuple[str, bytes]:
                prompt = f"client-{i:03d}-"
                r = await client.post(
                    "/v1/completions", json={"prompt": prompt, "stream": i % 3 == 0}
                )
                assert r.status_code == 200, r.content
                return prompt, r.content

            got = await asyncio.gather(*(one(i) for i in range(24)))
    _assert_own_answers(list(got))
