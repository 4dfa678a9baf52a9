"""The upstream client's own cost: CPU per request of ``pdproxy.upstream.pool`` against a floor.

``bench_proxy`` measures the whole proxy, whose CPU per request varies by tens of percent on a
shared machine; this isolates the client. A fake engine (``loadtest.fake_backend``) runs in
another process; this process sends ``POST /v1/completions`` legs to it with

- ``floor``: a bare asyncio protocol per connection that writes a preformatted request and
  waits for the end of the answer (content-length or the last chunk), parsing nothing else:
  the least any HTTP/1.1 client can spend;
- ``http1``: :class:`pdproxy.upstream.pool.HostPool`, reading the whole answer (non-stream) or
chunk by chunk (a 64-chunk stream), as the proxy's legs do;
- ``aiohttp``: ``aiohttp.ClientSession`` doing the same, for scale.

Modes run interleaved, ``--rounds`` times, each cell bounded by ``--duration`` seconds and
``--max-requests``; it prints the median and minimum CPU µs per request and the median req/s
per mode, and the ratios against the floor measured in the same run.

    python -m loadtest.bench_http1 [--rounds 3] [--duration 1.0] [--concurrency 1 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from functools import partial

import aiohttp
import orjson

from loadtest.child import child_process
from pdproxy.origin import split_url
from pdproxy.settings import UpstreamSettings
from pdproxy.stack.ports import free_port
from pdproxy.upstream.pool import HostPool

_PATH = "/v1/completions"
_HEADERS = {"content-type": "application/json", "x-request-id": "bench-0123456789abcdef"}


def _body(stream: bool) -> bytes:
    prompt = "the quick brown fox " * 20
    return orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 64, "stream": stream})


class _FloorConn(asyncio.Protocol):
    """Writes a request, waits until the answer's last byte: no parsing beyond framing."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        head_end = self._buf.find(b"\r\n\r\n")
        if head_end < 0 or self._done is None or self._done.done():
            return
        head = bytes(self._buf[:head_end]).lower()
        marker = head.find(b"content-length:")
        if marker >= 0:
            length = int(head[marker + 15 :].split(b"\r\n", 1)[0])
            complete = len(self._buf) >= head_end + 4 + length
        else:
            complete = self._buf.endswith(b"0\r\n\r\n")
        if complete:
            self._buf.clear()
            self._done.set_result(None)

    async def call(self, data: bytes) -> None:
        assert self.transport is not None
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        await self._done


Call = Callable[[], Awaitable[None]]
_Calls = tuple[list[Call], Callable[[], Awaitable[None]]]


async def _floor_calls(url: str, stream: bool, n: int) -> _Calls:
    origin, _ = split_url(url)
    body = _body(stream)
    head = f"POST {_PATH} HTTP/1.1\r\nhost: {origin.host_header}\r\n"
    head += f"content-length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in _HEADERS.items()) + "\r\n"
    data = head.encode() + body
    loop = asyncio.get_running_loop()
    conns = [
        (await loop.create_connection(_FloorConn, origin.host, origin.port))[1] for _ in range(n)
    ]

    async def close() -> None:
        for c in conns:
            if c.transport is not None:
                c.transport.close()

    return [partial(c.call, data) for c in conns], close


async def _http1_calls(url: str, stream: bool, n: int) -> _Calls:
    origin, _ = split_url(url)
    pool = HostPool(origin, 3.0, UpstreamSettings())
    body = _body(stream)

    async def call() -> None:
        resp = await pool.request("POST", _PATH, _HEADERS, body)
        if stream:
            while await resp.read_chunk():
                pass
            resp.release()
        else:
            await resp.read()

    async def close() -> None:
        pool.close()

    return [call] * n, close


async def _aiohttp_calls(url: str, stream: bool, n: int) -> _Calls:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    body = _body(stream)

    async def call() -> None:
        async with session.post(url + _PATH, data=body, headers=_HEADERS) as resp:
            if stream:
                while await resp.content.readany():
                    pass
            else:
                await resp.read()

    async def close() -> None:
        await session.close()

    return [call] * n, close


_MODES = {"floor": _floor_calls, "http1": _http1_calls, "aiohttp": _aiohttp_calls}


async def _cell(
    mode: str, url: str, stream: bool, concurrency: int, args: argparse.Namespace
) -> tuple[float, float]:
    """(CPU µs per request, req/s) of one mode at one concurrency."""
    duration, max_requests = args.duration, args.max_requests
    calls, close = await _MODES[mode](url, stream, concurrency)
    done = 0
    try:
        for call in calls:  # warm the connections
            await call()
        cpu0, t0 = time.process_time(), time.perf_counter()
        deadline = t0 + duration

        async def worker(call: Call) -> None:
            nonlocal done
            while time.perf_counter() < deadline and done < max_requests:
                await call()
                done += 1

        await asyncio.gather(*(worker(c) for c in calls))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        await close()
        await asyncio.sleep(0.05)
    return cpu / max(done, 1) * 1e6, done / wall


@contextlib.contextmanager
def _fake_engine(port: int) -> Iterator[None]:
    argv = [sys.executable, "-m", "loadtest.fake_backend", "--chunks", "64",
            "--listen", f"D={port}"]  # fmt: skip
    with child_process(argv):
        yield


async def _wait_ready(url: str) -> None:
    origin, _ = split_url(url)
    for _ in range(400):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(origin.host, origin.port)
            writer.close()
            return
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never accepted a connection")


async def _bench(args: argparse.Namespace) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _fake_engine(port):
        await _wait_ready(url)
        results: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for kind in ("nonstream", "stream64"):
                for c in args.concurrency:
                    for mode in _MODES:
                        cell = await _cell(mode, url, kind == "stream64", c, args)
                        results.setdefault((kind, c, mode), []).append(cell)
    _report(results)


def _report(results: dict[tuple[str, int, str], list[tuple[float, float]]]) -> None:
    """Medians, and the minimum CPU per request: on a shared machine other load only adds."""
    print(f"{'kind':<10} {'c':>3} {'mode':<8} {'CPU us/req':>10} {'min':>7} {'req/s':>8}")
    stats: dict[tuple[str, int, str], tuple[float, float, float]] = {}
    for key, cells in results.items():
        cpu = statistics.median(c[0] for c in cells)
        low = min(c[0] for c in cells)
        rps = statistics.median(c[1] for c in cells)
        stats[key] = (cpu, low, rps)
        kind, c, mode = key
        print(f"{kind:<10} {c:>3} {mode:<8} {cpu:>10.1f} {low:>7.1f} {rps:>8.0f}")
    print("\nagainst the floor (same run; CPU median and min, req/s median):")
    for (kind, c, mode), (cpu, low, rps) in stats.items():
        if mode == "floor":
            continue
        f_cpu, f_low, f_rps = stats[(kind, c, "floor")]
        print(
            f"  {kind:<10} c={c:<3} {mode:<8} CPU x{cpu / f_cpu:.2f} (+{cpu - f_cpu:.0f} us/req), "
            f"min x{low / f_low:.2f} (+{low - f_low:.0f} us/req)  req/s x{rps / f_rps:.2f}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="pdproxy.upstream.pool CPU per request vs a floor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per cell")
    parser.add_argument("--max-requests", type=int, default=5000, help="requests per cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_bench(args))
    except ImportError:
        asyncio.run(_bench(args))


if __name__ == "__main__":
    main()
