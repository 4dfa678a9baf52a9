"""The upstream client against upstreams that frame answers badly on purpose (raw TCP servers on
loopback): oversized heads and trailers, close-delimited bodies, repeated fields, IPv6, and
targets or header values that would break the request's own framing.

Interim answers, unsolicited bytes and resending are in ``test_http1_hostile.py``.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdproxy.errors import (
    HttpClientError,
    ResponseHeadTooLarge,
    ResponseTooLarge,
)
from tests.pdproxy.raw_upstream import answer, pool_for, raw_server

# -- head caps


@pytest.mark.parametrize(
    ("head", "match"),
    [
        (b"".join(b"x-f%d: v\r\n" % i for i in range(101)), "fields"),
        (b"x-big: " + b"a" * 70_000 + b"\r\n", "bytes"),
    ],
    ids=["101-fields", "70KiB-field"],
)
async def test_oversized_heads_are_refused(head: bytes, match: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 2\r\n\r\nhi")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        with pytest.raises(ResponseHeadTooLarge, match=match):
            await pool.request("POST", "/", {}, b"x")
        pool.close()


async def test_a_head_dripped_slowly_past_the_cap_is_refused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nx-slow: ")
        for _ in range(2000):  # one never-ending field, 64 bytes at a time
            writer.write(b"b" * 64)
            await writer.drain()
            await asyncio.sleep(0)

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url, max_head_bytes=8192)
        with pytest.raises(ResponseHeadTooLarge):
            await pool.request("POST", "/", {}, b"x")
        pool.close()


async def test_heads_under_the_caps_pass() -> None:
    fields = b"".join(b"x-f%d: %s\r\n" % (i, b"v" * 500) for i in range(90))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + fields + b"content-length: 2\r\n\r\nhi")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("POST", "/", {}, b"x")
        assert len(resp.headers) == 91 and await resp.read() == b"hi"
        pool.close()


# -- framing


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n",
        b"HTTP/1.0 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n",
    ],
    ids=["1.1-close", "1.0", "1.1-unframed"],
)
async def test_close_delimited_bodies_are_read_to_eof_and_not_reused(head: bytes) -> None:
    body = b'{"choices": [{"text": "close-delimited"}]}' * 100

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(head + body[:1000])
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(body[1000:])
        await writer.drain()
        writer.close()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        for _ in range(2):
            resp = await pool.request("POST", "/", {}, b"x")
            assert resp.status == 200
            assert await resp.read() == body
        pool.close()
    assert srv.connections == 2


async def test_a_reset_ends_a_close_delimited_body_with_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.02)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()  # RST, not FIN

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("POST", "/", {}, b"x")
        with pytest.raises(HttpClientError, match="closed early"):
            await resp.read()
        pool.close()


async def test_chunked_trailers_are_kept_apart_from_the_head() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await srv.read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/plain\r\n"
                b"\r\n5\r\nhello\r\n6\r\n world\r\n0\r\nx-checksum: abc\r\nx-tokens: 7\r\n\r\n"
            )
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        for _ in range(2):
            resp = await pool.request("POST", "/", {}, b"x")
            assert await resp.read() == b"hello world"
            assert resp.headers == {"transfer-encoding": "chunked", "content-type": "text/plain"}
            assert resp.trailers == {"x-checksum": "abc", "x-tokens": "7"}
        pool.close()
    assert srv.connections == 1


async def test_too_many_trailers_are_refused() -> None:
    trailers = b"".join(b"x-t%d: v\r\n" % i for i in range(200))

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n"
            + trailers
            + b"\r\n"
        )
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("POST", "/", {}, b"x")
        with pytest.raises(ResponseHeadTooLarge):
            await resp.read()
        pool.close()


async def test_a_trailer_line_that_never_ends_is_refused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        writer.write(b"0\r\nx-endless: ")
        for _ in range(2000):
            writer.write(b"t" * 64)
            await writer.drain()
            await asyncio.sleep(0)

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url, max_head_bytes=8192)
        resp = await pool.request("POST", "/", {}, b"x")
        with pytest.raises(ResponseHeadTooLarge, match="trailers"):
            await resp.read()
        pool.close()


async def test_an_answer_read_whole_is_capped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n")
        for _ in range(200):  # 12.8 MiB at most, then the handler gives up
            writer.write(b"a" * 65536)
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url, max_answer_bytes=1024 * 1024)
        resp = await pool.request("POST", "/", {}, b"x")
        with pytest.raises(ResponseTooLarge, match="1048576"):
            await resp.read()
        pool.close()


async def test_repeated_fields_are_joined_not_overwritten() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"x", b"x-model: a\r\nX-Model: b\r\nvary: accept\r\n"))
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("GET", "/", {})
        assert resp.headers["x-model"] == "a, b"
        assert resp.headers["vary"] == "accept"
        await resp.read()
        pool.close()


# -- addressing


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
async def test_ipv6_hosts_connect_and_send_a_bracketed_host_header() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"v6"))
        await writer.drain()
        await reader.read()

    async with raw_server(handler, host="::1") as srv:
        pool = pool_for(srv.url)
        assert await (await pool.request("GET", "/health", {})).read() == b"v6"
        pool.close()
    assert b"\r\nhost: [::1]:%d\r\n" % srv.port in srv.requests[0]


def test_request_targets_and_header_values_cannot_break_framing() -> None:
    pool = pool_for("http://127.0.0.1:1")
    for target in ("/a b", "/a\r\nx: y", "no-slash"):
        with pytest.raises(ValueError, match="target"):
            asyncio.run(pool.request("GET", target, {}))
    with pytest.raises(ValueError, match="line break"):
        asyncio.run(pool.request("GET", "/", {"x-evil\r\nhost": "v"}))
