"""The upstream HTTP/1.1 client against small raw servers that script each answer."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.upstream.pool import HttpClientError
from tests.pdproxy.raw_upstream import answer, pool_for, raw_server


async def test_keep_alive_reuses_one_connection() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head, body = await srv.read_request(reader)
            seen.append(head + body)
            writer.write(answer(b'{"ok":true}', b"content-type: application/json\r\n"))
            await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        for i in range(3):
            resp = await pool.request("POST", "/v1/x", {"x-request-id": f"r{i}"}, b"{}")
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            assert await resp.read() == b'{"ok":true}'
        pool.close()
    assert srv.connections == 1
    assert seen[0].startswith(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:")
    assert b"content-length: 2\r\n" in seen[0] and seen[0].endswith(b"\r\n\r\n{}")
    assert b"x-request-id: r2\r\n" in seen[2]


async def test_connection_close_and_stale_connections_get_a_fresh_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(b"a"))  # keep-alive implied, but the server closes anyway
        await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        for _ in range(3):
            resp = await pool.request("GET", "/", {})
            assert await resp.read() == b"a"
        pool.close()
    assert srv.connections == 3


async def test_chunked_body_arrives_whole_and_in_order() -> None:
    parts = [b"data: %d\n\n" % i for i in range(50)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("POST", "/", {}, b"")
        got = b""
        while chunk := await resp.read_chunk():
            got += chunk
        assert got == b"".join(parts)
        assert resp.at_eof
        resp.release()
        pool.close()


async def test_large_body_with_flow_control() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(answer(body))
        await writer.drain()

    async with raw_server(handler) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("GET", "/", {})
        got = bytearray()
        while chunk := await resp.read_chunk():
            got += chunk
            await asyncio.sleep(0)
        assert bytes(got) == body
        pool.close()


async def test_connect_refused_and_cut_responses_raise() -> None:
    pool = pool_for("http://127.0.0.1:9")
    with pytest.raises(HttpClientError, match="connect"):
        await pool.request("GET", "/", {})

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly-part")
        await writer.drain()

    async with raw_server(cut) as srv:
        pool = pool_for(srv.url)
        resp = await pool.request("GET", "/", {})
        with pytest.raises(HttpClientError, match="closed early"):
            await resp.read()
        pool.close()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with raw_server(garbage) as srv:
        pool = pool_for(srv.url)
        with pytest.raises(HttpClientError, match="invalid HTTP"):
            await pool.request("GET", "/", {})
        pool.close()


async def test_cancelling_a_request_closes_its_connection() -> None:
    got_request = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await srv.read_request(reader)
        got_request.set()
        await reader.read()  # returns at EOF: the client went away

    async with raw_server(silent) as srv:
        pool = pool_for(srv.url)
        task = asyncio.create_task(pool.request("POST", "/", {}, b"x"))
        await asyncio.wait_for(got_request.wait(), 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if srv.closed_by_peer:
                break
            await asyncio.sleep(0.01)
        assert srv.closed_by_peer == 1
        pool.close()


def test_header_injection_is_refused() -> None:
    pool = pool_for("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="line break"):
        asyncio.run(pool.request("GET", "/", {"x-evil": "a\r\nHost: other"}))


def test_only_http_urls() -> None:
    with pytest.raises(ValueError):
        pool_for("ftp://h/")
