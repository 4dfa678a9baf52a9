"""The upstream client against upstreams that misbehave on purpose (raw TCP servers on loopback).

Each test plays one hostile or sloppy upstream: interim (1xx) answers, unsolicited bytes on an
idle or finished connection, connections closed right after reading a request. Heads, bodies
and addressing are in ``test_http1_framing.py``.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from pdproxy.errors import (
    HttpClientError,
    RequestNotSent,
    ResponseHeadTooLarge,
)
from tests.pdproxy.raw_upstream import answer, pool_for, raw_server

# -- 1xx


async def test_interim_answers_are_skipped_and_the_final_one_is_the_answer() -> None:
    interim = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\nx-leak: 103\r\n\r\n"
        b"HTTP/1.1 102 Processing\r\n\r\n"
    )

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while True:
            await srv.read_request(reader)
            n += 1
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.01)  # the final answer in a later packet
            writer.write(answer(b"answer-%d" % n, b"content-type: application/json\r\n"))
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        for n in (1, 2, 3):
            resp = await pool.request("POST", "/v1/completions", {}, b"{}")
            assert resp.status == 200
            assert "x-leak" not in resp.headers and "link" not in resp.headers
            assert resp.headers["content-type"] == "application/json"
            assert await resp.read() == b"answer-%d" % n
        pool.close()
    assert srv.connections == 1  # interim answers do not spoil the connection


async def test_101_switching_protocols_is_refused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\nPRI * HTTP/2.0")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        with pytest.raises(HttpClientError, match="101"):
            await pool.request("POST", "/", {}, b"x")
        pool.close()


async def test_endless_interim_answers_hit_the_head_cap() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        for _ in range(10_000):  # bounded even if the client never gave up
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 16)
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url, max_head_bytes=4096)
        with pytest.raises(ResponseHeadTooLarge):
            await pool.request("POST", "/", {}, b"x")
        pool.close()


# -- unsolicited bytes


async def test_bytes_sent_to_an_idle_connection_close_it() -> None:
    """The stray answer must never become the next request's answer."""
    stray_sent = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"first"))
        await writer.drain()
        await asyncio.sleep(0.05)  # the client has pooled the connection by now
        writer.write(answer(b"INJECTED-stray-answer"))
        await writer.drain()
        stray_sent.set()
        while True:
            await srv.read_request(reader)
            writer.write(answer(b"fresh"))
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        assert await (await pool.request("GET", "/", {})).read() == b"first"
        await asyncio.wait_for(stray_sent.wait(), 5)
        await asyncio.sleep(0.05)  # let the loop deliver the stray bytes
        second = await (await pool.request("POST", "/", {}, b"x")).read()
        pool.close()
    assert second == b"first"  # a new connection: the handler answers "first" again
    assert b"INJECTED" not in second
    assert srv.connections == 2


async def test_bytes_not_yet_read_by_the_loop_still_keep_a_connection_from_reuse() -> None:
    """The stray answer reaches the socket, and the next request is sent in the same loop step:
    the loop never called data_received, the socket check before reuse must catch it."""
    writers: list[asyncio.StreamWriter] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while True:
            await srv.read_request(reader)
            writer.write(answer(b"conn-%d" % len(writers)))
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        assert await (await pool.request("GET", "/", {})).read() == b"conn-1"
        await asyncio.sleep(0.02)
        fd = writers[0].transport.get_extra_info("socket").fileno()
        os.write(fd, answer(b"INJECTED"))  # straight into the socket, no loop step after it
        second = await (await pool.request("POST", "/", {}, b"x")).read()
        pool.close()
    assert second == b"conn-2"
    assert srv.connections == 2


async def test_a_second_answer_in_the_same_packet_is_not_kept_for_the_next_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"mine") + answer(b"INJECTED-piggyback"))  # one write, one packet
        await writer.drain()
        while True:
            await srv.read_request(reader)
            writer.write(answer(b"never-read"))
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        assert await (await pool.request("POST", "/", {}, b"a")).read() == b"mine"
        second = await (await pool.request("POST", "/", {}, b"b")).read()
        pool.close()
    assert second == b"mine"
    assert srv.connections == 2


async def test_an_unsolicited_head_cut_in_two_never_becomes_the_next_answer() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"mine") + b"HTTP/1.1 200 OK\r\nx-st")  # the stray starts...
        await writer.drain()
        await srv.read_request(reader)  # ...and ends once the next request is in
        writer.write(b"ray: 1\r\ncontent-length: 8\r\n\r\nINJECTED" + answer(b"late"))
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        first = await pool.request("POST", "/", {}, b"a")
        assert await first.read() == b"mine"
        assert first.trailers == {}
        second = await (await pool.request("POST", "/", {}, b"b")).read()
        pool.close()
    assert second == b"mine"  # a fresh connection, answered from the start
    assert srv.connections == 2


async def test_garbage_after_a_complete_answer_keeps_the_answer_and_drops_the_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"mine") + b"INJECTED not even http\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("POST", "/", {}, b"a")
        assert await resp.read() == b"mine"
        assert resp.status == 200
        pool.close()
    assert srv.connections == 1


# -- resending


async def test_a_post_is_never_sent_twice_when_a_kept_alive_connection_closes() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"warm-up"))
        await writer.drain()
        await srv.read_request(reader)  # read the prefill... and hang up without a byte
        writer.transport.abort()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        assert await (await pool.request("POST", "/v1/completions", {}, b"one")).read()
        with pytest.raises(HttpClientError, match="closed early"):
            await pool.request("POST", "/v1/completions", {}, b"prefill")
        pool.close()
    prefills = [r for r in srv.requests if r.endswith(b"prefill")]
    assert len(prefills) == 1, srv.requests
    assert srv.connections == 1


async def test_a_get_is_resent_once_on_a_fresh_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"ok"))
        await writer.drain()
        if srv.connections == 1:
            await srv.read_request(reader)
            writer.transport.abort()  # the idle-close race: read, then gone

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        assert await (await pool.request("GET", "/health", {})).read() == b"ok"
        assert await (await pool.request("GET", "/health", {})).read() == b"ok"
        pool.close()
    assert len(srv.requests) == 3 and srv.connections == 2


async def test_a_connection_idle_past_idle_s_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await srv.read_request(reader)
            writer.write(answer(b"ok"))
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url, idle_s=0.05)
        assert await (await pool.request("POST", "/", {}, b"1")).read() == b"ok"
        assert await (await pool.request("POST", "/", {}, b"2")).read() == b"ok"
        assert srv.connections == 1
        await asyncio.sleep(0.1)
        assert await (await pool.request("POST", "/", {}, b"3")).read() == b"ok"
        pool.close()
    assert srv.connections == 2


async def test_connect_failure_says_nothing_was_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        pool = pool_for(f"http://127.0.0.1:{port}")
        with pytest.raises(RequestNotSent):
            await pool.request("POST", "/", {}, b"x")
