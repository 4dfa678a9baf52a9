"""The front of the completion routes, option by option, in one run: what the HTTP server and
its interface cost per request before the request path does any work.

Each option serves ``POST /v1/completions`` with the same trivial handler (read the whole
body, answer a fixed ~400-byte JSON completion, keep the connection alive), so what differs
is only the front:

- ``starlette-route``: uvicorn (httptools, uvloop) + a FastAPI/Starlette route, ``Request`` and
  ``Response`` (the cold routes today);
- ``asgi-fastpath``: today's hot route: pdproxy's gated uvicorn protocol, ``ProxyApp``'s ASGI
  ``__call__`` dispatching on the path, ``HotRequest``, ``read_body`` (size cap, deadline) and
  a Starlette ``Response``;
- ``uvicorn-direct``: pdproxy's gated uvicorn protocol (its head caps, gate, keep-alive) whose
  hot route skips ASGI: the body is collected by the parser callbacks and one task per request
  writes the answer straight to the transport;
- ``raw-protocol``: a bare ``asyncio.Protocol`` on ``httptools.HttpRequestParser`` (no caps, no
  gate: the floor of a Python front on uvloop);
- ``granian-rsgi``: granian's Rust HTTP/1 server (embedded, one runtime thread) calling an RSGI
  app; only when ``granian`` is importable (``--granian-path`` adds a directory to its
  ``sys.path``).

For each option it reports req/s and the server's CPU ms per request at ``--concurrency``
(aiohttp client, same run, options alternated ``--rounds`` times) and, with ``--instructions``,
instructions and calls into the allocator per request under valgrind's callgrind (counts do
not move with the load of a shared machine; CPU seconds do).

    python -m loadtest.bench_vs_router_fronts [--requests 3000] [--concurrency 16] [--rounds 2]
        [--instructions 300] [--granian-path DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httptools
import orjson

from loadtest.bench_proxy import _run_cell
from loadtest.bench_vs_router import _body, _post, tree_cpu_seconds
from loadtest.child import child_process
from pdproxy.stack.ports import free_port

FRONTS = ("starlette-route", "asgi-fastpath", "uvicorn-direct", "raw-protocol", "granian-rsgi")
PATH = "/v1/completions"
ANSWER = orjson.dumps(
    {
        "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "fake-model",
        "choices": [{"index": 0, "text": " the quick brown fox" * 4, "finish_reason": "length",
                     "logprobs": None}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
)  # fmt: skip
MAX_BODY = 16 * 1024 * 1024
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(
    ANSWER
)


# ------------------------------------------------------------------ the servers (child process)


def _serve_uvicorn(kind: str, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from pdproxy.front.connections import ConnectionGate
    from pdproxy.front.intake import read_body
    from pdproxy.front.protocol import HotRequest, gated_protocol
    from pdproxy.settings import AdmissionSettings

    gate = ConnectionGate(AdmissionSettings())

    class FastPathApp(FastAPI):
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == PATH:
                request = HotRequest(scope, receive)
                await read_body(request.receive, MAX_BODY, 30.0)
                response = Response(ANSWER, media_type="application/json")
                await response(scope, receive, send)
                return
            await super().__call__(scope, receive, send)

    async def route(request: Request) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    app = FastPathApp() if kind == "asgi-fastpath" else FastAPI()
    app.add_route(PATH, route, methods=["POST"])
    http: Any = "httptools"
    if kind == "asgi-fastpath":
        http = gated_protocol(gate)
    elif kind == "uvicorn-direct":
        gated: Any = gated_protocol(gate)

        class Direct(gated):  # type: ignore[misc]
            """The hot route's body gathered by the parser; one task answers it."""

            _body: list[bytes] | None = None
            _waiting: bool
            timeout_keep_alive_task: asyncio.TimerHandle | None

            def on_headers_complete(self) -> None:
                if self.parser.get_method() == b"POST" and self.url == PATH.encode():
                    self._head_done = True
                    if self._waiting:
                        self._waiting = False
                        gate.done(self)
                    self._body = []
                    if self.timeout_keep_alive_task is not None:
                        self.timeout_keep_alive_task.cancel()
                        self.timeout_keep_alive_task = None
                    return
                super().on_headers_complete()

            def on_body(self, body: bytes) -> None:
                if self._body is not None:
                    self._body.append(body)
                    return
                super().on_body(body)

            def on_message_complete(self) -> None:
                body = self._body
                if body is None:
                    super().on_message_complete()
                    return
                self._body = None
                self._head_done = False
                self._head_bytes = 0
                task = self.loop.create_task(self._answer(b"".join(body)))
                task.add_done_callback(self.tasks.discard)
                self.tasks.add(task)

            async def _answer(self, body: bytes) -> None:
                self.transport.write(_HEAD + ANSWER)
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
                if not self._waiting:
                    self._waiting = True
                    gate.wait(self, self._source)

        http = Direct
    # As ``pdproxy serve`` runs uvicorn: no proxy-headers middleware, no access log.
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http=http, access_log=False,
                proxy_headers=False, log_level="warning", server_header=False,
                lifespan="off")  # fmt: skip


class _RawProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive on httptools, one task per request; no limits at all (a floor)."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_message_begin(self) -> None:
        self._headers = []
        self._body = []
        self._url = b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        asyncio.get_running_loop().create_task(self._answer(b"".join(self._body)))

    async def _answer(self, body: bytes) -> None:
        assert self._transport is not None
        self._transport.write(_HEAD + ANSWER)


def _serve_raw(port: int) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_RawProtocol, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    uvloop.run(main())


class RsgiApp:
    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        await protocol()
        protocol.response_bytes(200, [("content-type", "application/json")], ANSWER)


def _serve_granian(port: int) -> None:
    import uvloop

    # Imported by name: granian is a benchmark option, not a dependency of the proxy.
    server_class = importlib.import_module("granian.server.embed").Server

    async def main() -> None:
        server = server_class(RsgiApp(), address="127.0.0.1", port=port, interface="rsgi",
                        runtime_threads=1, log_enabled=False)  # fmt: skip
        await server.serve()

    uvloop.run(main())


def serve(kind: str, port: int) -> None:
    if kind == "raw-protocol":
        _serve_raw(port)
    elif kind == "granian-rsgi":
        _serve_granian(port)
    else:
        _serve_uvicorn(kind, port)


# ------------------------------------------------------------------ the load (parent)


async def _up(session: aiohttp.ClientSession, url: str, timeout_s: float = 300) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            with contextlib.suppress(aiohttp.ClientError, RuntimeError):
                await _post(session, url, _body(False, 16))
                return
            await asyncio.sleep(0.2)


def _argv(kind: str, port: int, callgrind_out: Path | None) -> list[str]:
    argv = [sys.executable, "-m", "loadtest.bench_vs_router_fronts", "--serve", kind,
            "--port", str(port)]  # fmt: skip
    if callgrind_out is None:
        return argv
    return ["valgrind", "-q", "--tool=callgrind", "--instr-atstart=no",
            f"--callgrind-out-file={callgrind_out}", *argv]  # fmt: skip


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if args.granian_path:
        paths = [env.get("PYTHONPATH"), args.granian_path]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


async def _cpu_rounds(
    args: argparse.Namespace, fronts: list[str]
) -> dict[str, tuple[int, float, float]]:
    """Per front: requests, seconds, CPU seconds (rounds added up)."""
    totals = {kind: (0, 0.0, 0.0) for kind in fronts}
    with contextlib.ExitStack() as stack:
        urls: dict[str, tuple[str, int]] = {}
        for kind in fronts:
            port = free_port()
            proc = stack.enter_context(child_process(_argv(kind, port, None), env=_env(args)))
            urls[kind] = (f"http://127.0.0.1:{port}{PATH}", proc.pid)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for url, _ in urls.values():
                await _up(session, url)
                warm: Callable[[], Awaitable[float]] = partial(
                    _post, session, url, _body(False, 16)
                )
                await _run_cell(warm, args.concurrency, 30, 300)
            for _ in range(args.rounds):
                for kind in fronts:
                    url, pid = urls[kind]
                    call = partial(_post, session, url, _body(False, 16))
                    cpu0 = tree_cpu_seconds(pid)
                    lat, _, errors, secs = await _run_cell(
                        call, args.concurrency, args.duration, args.requests
                    )
                    cpu = tree_cpu_seconds(pid) - cpu0
                    if errors:
                        raise RuntimeError(f"{kind}: {errors} requests failed")
                    n, s, c = totals[kind]
                    totals[kind] = (n + len(lat), s + secs, c + cpu)
    return totals


ALLOCATORS = ("PyObject_Malloc", "PyObject_Calloc", "PyMem_Malloc", "PyMem_Calloc")
"""Python's allocation entry points (each call is one block asked for by Python code or an
extension); libc ``malloc`` is counted apart (large blocks, C libraries' own)."""


def callgrind_counts(dump: Path, callees: tuple[str, ...]) -> tuple[int, dict[str, int]]:
    """Instructions in ``dump`` and the calls made to each function named in ``callees``."""
    names: dict[str, str] = {}
    calls = dict.fromkeys(callees, 0)
    total = 0
    callee: str | None = None
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("cfn="):
            ref, _, name = line[4:].partition(" ")
            if name:
                names[ref] = name
            callee = names.get(ref)
        elif line.startswith("fn="):
            ref, _, name = line[3:].partition(" ")
            if name:
                names[ref] = name
        elif line.startswith("calls=") and callee in calls:
            calls[callee] += int(line[6:].split()[0])
        elif line.startswith("totals:"):
            total = int(line.split()[1])
    return total, calls


def callgrind_by_object(dump: Path) -> dict[str, int]:
    """Self instructions in ``dump`` per ELF object (the interpreter, uvloop, httptools,
    orjson, libc, a Rust extension...): where a server's instructions go, by library."""
    names: dict[str, str] = {}
    by_object: dict[str, int] = {}
    current = "?"
    skip_next = False  # the cost line after ``calls=`` is the call's inclusive cost
    for line in dump.read_text(errors="replace").splitlines():
        if not line:
            continue
        first = line[0]
        if first.isdigit() or first in "+-*":
            if skip_next:
                skip_next = False
                continue
            by_object[current] = by_object.get(current, 0) + int(line.split()[-1])
        elif line.startswith(("ob=", "cob=")):
            ref, _, name = line.partition("=")[2].partition(" ")
            if name:  # a name is given once, where first used, by either kind of line
                names[ref] = name
            if line[0] == "o":
                current = names.get(ref, ref)
        elif line.startswith("calls="):
            skip_next = True
    return by_object


async def _instructions(
    args: argparse.Namespace, kind: str, out_dir: Path
) -> tuple[float, float, float]:
    """Instructions, Python allocations and libc mallocs per request for one front."""
    port = free_port()
    out = out_dir / f"callgrind.{kind}"
    url = f"http://127.0.0.1:{port}{PATH}"
    n = args.instructions
    with child_process(_argv(kind, port, out), env=_env(args)) as proc:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _up(session, url)
            call = partial(_post, session, url, _body(False, 16))
            await _run_cell(call, args.concurrency, 600, 100)
            control = partial(subprocess.run, check=True, capture_output=True)
            control(["callgrind_control", "-i", "on", str(proc.pid)])
            _, _, errors, _ = await _run_cell(call, args.concurrency, 600, n)
            control(["callgrind_control", "-d", str(proc.pid)])
            control(["callgrind_control", "-i", "off", str(proc.pid)])
    if errors:
        raise RuntimeError(f"{kind}: {errors} requests failed")
    total, calls = callgrind_counts(Path(f"{out}.1"), (*ALLOCATORS, "malloc"))
    python_allocs = sum(calls[name] for name in ALLOCATORS)
    return total / n, python_allocs / n, calls["malloc"] / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the completion routes' front, option by option")
    parser.add_argument("--serve", choices=FRONTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=3000, help="requests per round")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per round at most")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--instructions", type=int, default=0, metavar="N",
        help="also count instructions over N requests per front (callgrind)",
    )  # fmt: skip
    parser.add_argument("--granian-path", help="directory holding granian (added to sys.path)")
    parser.add_argument("--fronts", nargs="+", choices=FRONTS, default=list(FRONTS))
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return
    fronts = list(args.fronts)
    if "granian-rsgi" in fronts:
        probe = [sys.executable, "-c", "import granian"]
        if subprocess.run(probe, check=False, env=_env(args), capture_output=True).returncode:
            print("granian is not importable: its row is skipped", file=sys.stderr)
            fronts.remove("granian-rsgi")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    totals = asyncio.run(_cpu_rounds(args, fronts))
    counts: dict[str, tuple[float, float, float]] = {}
    if args.instructions:
        if shutil.which("valgrind") is None:
            sys.exit("valgrind not found (Debian: apt-get install valgrind)")
        with tempfile.TemporaryDirectory() as tmp:
            for kind in fronts:
                counts[kind] = asyncio.run(_instructions(args, kind, Path(tmp)))
    base = totals[fronts[0]]
    base_cpu = base[2] / base[0]
    print(f"front, c={args.concurrency}, {args.rounds} round(s); ratios to {fronts[0]}")
    print(f"{'front':<16} {'req/s':>7} {'CPU us/req':>10} {'CPU x':>6} "
          f"{'instr/req':>10} {'instr x':>7} {'py allocs':>9} {'mallocs':>8}")  # fmt: skip
    base_ir = counts[fronts[0]][0] if counts else 0.0
    for kind in fronts:
        n, secs, cpu = totals[kind]
        line = f"{kind:<16} {n / secs:>7.0f} {cpu / n * 1e6:>10.1f} {cpu / n / base_cpu:>6.2f}"
        if kind in counts:
            ir, allocs, mallocs = counts[kind]
            line += f" {ir:>10,.0f} {ir / base_ir:>7.2f} {allocs:>9.1f} {mallocs:>8.1f}"
        print(line)


if __name__ == "__main__":
    main()
