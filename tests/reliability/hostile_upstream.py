"""An OpenAI-ish engine on a raw TCP socket that frames its answers the way an attacker would.

Every answer names the prompt it answers (``answer-for-<prompt>``), so a client can tell when it
got somebody else's bytes. Modes, set per server and switchable while it runs:

- ``interim``: raw interim (1xx) responses sent before every answer;
- ``stray``: an unsolicited extra response sent right after every answer, either glued to it
  (same write) or as its own write, alternately: the proxy must not hand it to anyone;
- ``close_delimited``: answers without content-length or chunking, ended by closing;
- ``head_padding``: header fields added to every head (to pass the proxy's head caps).

A producer (NIXL dialect) answers ``kv_transfer_params`` carrying the prompt it prefilled; the
consumer checks that the params it receives name its own prompt, else it answers ``MISMATCH``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import orjson

INJECTED = b"INJECTED"


@dataclass
class HostileModes:
    interim: bytes = b""
    stray: bool = False
    close_delimited: bool = False
    head_padding: bytes = b""


@dataclass
class HostileEngine:
    name: str
    producer: bool
    modes: HostileModes = field(default_factory=HostileModes)
    connections: int = 0
    requests: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> HostileEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # closing: asyncio 3.11 would log a cancelled stream handler as an error
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests += 1
        modes = self.modes
        if modes.interim:
            writer.write(modes.interim)
            await writer.drain()
            await asyncio.sleep(0)
        if head.startswith(b"GET"):
            payload, content_type, stream = b'{"status": "ok"}', b"application/json", False
        else:
            payload, content_type, stream = self._answer(orjson.loads(body))
        framing = b"transfer-encoding: chunked\r\n" if stream else b""
        if stream:
            payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
        if modes.close_delimited and not stream:
            framing = b"connection: close\r\n"
        else:
            framing += b"" if stream else b"content-length: %d\r\n" % len(payload)
        out = (
            b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\n"
            + framing + modes.head_padding + b"\r\n" + payload
        )  # fmt: skip
        stray = b"HTTP/1.1 200 OK\r\ncontent-length: 16\r\n\r\n" + INJECTED + b"-stray!!"
        if modes.stray and self.requests % 2:
            out += stray  # glued: one write, one packet
        writer.write(out)
        await writer.drain()
        if modes.stray and not self.requests % 2:
            writer.write(stray)  # its own write, right behind the answer
            await writer.drain()
        return not (modes.close_delimited and not stream)

    def _answer(self, request: dict[str, object]) -> tuple[bytes, bytes, bool]:
        prompt = str(request.get("prompt"))
        if self.producer:
            kvp = {"do_remote_prefill": True, "remote_engine_id": self.name, "prompt": prompt}
            data = {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": kvp}
            return orjson.dumps(data), b"application/json", False
        received = request.get("kv_transfer_params")
        mismatch = isinstance(received, dict) and received.get("prompt") not in (None, prompt)
        text = "MISMATCH" if mismatch else f"answer-for-{prompt}"
        if request.get("stream"):
            event = orjson.dumps({"choices": [{"index": 0, "text": text}]})
            return b"data: " + event + b"\n\ndata: [DONE]\n\n", b"text/event-stream", True
        data = {"object": "text_completion", "choices": [{"index": 0, "text": text}]}
        return orjson.dumps(data), b"application/json", False
