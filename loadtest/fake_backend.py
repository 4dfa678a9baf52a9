"""Instant fake OpenAI engines for tests and benchmarks: small real HTTP servers (aiohttp).

A :class:`FakeBackend` answers ``/v1/completions`` and ``/v1/chat/completions`` like a vLLM
instance in a PD pair: a producer leg (``kv_transfer_params`` with ``do_remote_decode`` (NIXL)
or ``remote_decoder`` (P2P)) gets one token and the dialect's ``kv_transfer_params`` answer;
anything else is a consumer leg, streamed (SSE) or not as the body asks. It records every
request it receives (headers and raw body), counts requests whose client went away before the
answer was complete (aborts), records ``POST /v1/kv/release`` calls, and can be told to be
slow, fail with a status, hang, cut a stream, or answer garbage.

Run standalone (for benchmarks in another process)::

    python -m loadtest.fake_backend --listen P=8100 --listen D=8200 --chunks 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class Behavior:
    """How a fake answers; fields may be changed while it runs."""

    producer_delay_s: float = 0.0
    """Delay before a producer leg's answer."""
    first_chunk_delay_s: float = 0.0
    """Delay before a consumer's first chunk (or its whole non-stream answer)."""
    chunk_delay_s: float = 0.0
    """Delay between stream chunks."""
    chunks: int | None = None
    """Tokens per consumer answer; None: the body's ``max_tokens`` (default 4)."""
    fail_status: int | None = None
    """Answer completion requests with this status (and an OpenAI-shaped error)."""
    fail_count: int = -1
    """How many requests ``fail_status`` applies to (-1: all)."""
    fail_producer_only: bool = False
    hang: bool = False
    """Never answer completion requests (until the client leaves)."""
    cut_after_chunks: int | None = None
    """Cut the connection after this many stream chunks."""
    bad_producer_answer: bool = False
    """Answer producer legs without ``kv_transfer_params``."""
    health_status: int = 200
    cached_tokens: int | None = None
    """Reported as ``usage.prompt_tokens_details.cached_tokens`` when set."""
    p2p_port: int = 7000


def vllm_error(status: int) -> dict[str, Any]:
    """An error body as vLLM 0.32 writes it: the exception's class name as ``type`` and the
    HTTP status as an integer ``code``."""
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": "injected", "type": kind, "param": None, "code": status}}


def nixl_producer_answer(name: str, rid: str, host: str) -> dict[str, Any]:
    """A producer's ``kv_transfer_params`` with every key vLLM 0.32's NixlConnector returns:
    block ids per KV-cache group (a list of lists), and the keys engines added after the
    captures in ``shared/wire`` (``dcp_size``, ``pp_size``, ``remote_num_tokens``, ...)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": f"engine-{name}",
        "remote_request_id": f"cmpl-{rid}-0",
        "remote_host": host,
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 8,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
        "remote_prefill_cached_tokens": 0,
    }


@dataclass(frozen=True, slots=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    raw: bytes
    t: float

    def json(self) -> Any:
        return orjson.loads(self.raw) if self.raw else None

    @property
    def is_producer_leg(self) -> bool:
        body = self.json()
        kvp = body.get("kv_transfer_params") if isinstance(body, dict) else None
        return isinstance(kvp, dict) and (
            kvp.get("do_remote_decode") is True or "remote_decoder" in kvp
        )


@dataclass
class FakeBackend:
    name: str
    behavior: Behavior = field(default_factory=Behavior)
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "fake-model"
    received: list[Received] = field(default_factory=list)
    aborted: list[Received] = field(default_factory=list)
    """Completion requests whose client left before the answer was complete."""
    releases: list[str] = field(default_factory=list)
    """``kv_request_id`` of every ``POST /v1/kv/release``."""
    _runner: web.AppRunner | None = None
    _failed: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def aborts(self) -> int:
        return len(self.aborted)

    def completions(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("completions")]

    def producer_legs(self) -> list[Received]:
        return [r for r in self.completions() if r.is_producer_leg]

    def consumer_legs(self) -> list[Received]:
        return [r for r in self.completions() if not r.is_producer_leg]

    async def start(self) -> FakeBackend:
        app = web.Application(client_max_size=64 * 2**20)  # near-limit prompts pass
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/kv/release", self._release)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        if self.port == 0:
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeBackend:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- handlers

    async def _record(self, request: web.Request) -> Received:
        rec = Received(
            method=request.method,
            path=request.path,
            headers={k.lower(): v for k, v in request.headers.items()},
            raw=await request.read(),
            t=time.monotonic(),
        )
        self.received.append(rec)
        return rec

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.behavior.health_status, text="")

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        body = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _release(self, request: web.Request) -> web.Response:
        rec = await self._record(request)
        self.releases.append(str(rec.json().get("kv_request_id")))
        return web.Response(body=b'{"released":true}', content_type="application/json")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        rec = await self._record(request)
        try:
            return await self._answer(request, rec)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.append(rec)  # the client left before the answer was complete
            raise

    def _should_fail(self, producer: bool) -> bool:
        b = self.behavior
        if b.fail_status is None or (b.fail_producer_only and not producer):
            return False
        if b.fail_count >= 0 and self._failed >= b.fail_count:
            return False
        self._failed += 1
        return True

    async def _answer(self, request: web.Request, rec: Received) -> web.StreamResponse:
        b = self.behavior
        body = rec.json()
        producer = rec.is_producer_leg
        if self._should_fail(producer):
            status = b.fail_status or 500
            err = orjson.dumps(vllm_error(status))
            return web.Response(status=status, body=err, content_type="application/json")
        if b.hang:
            await asyncio.Event().wait()
        chat = request.path.endswith("chat/completions")
        rid = request.headers.get("x-request-id", "none")
        if producer:
            await asyncio.sleep(b.producer_delay_s)
            return web.Response(
                body=orjson.dumps(self._producer_answer(body, rid, chat)),
                content_type="application/json",
            )
        n = b.chunks if b.chunks is not None else int(body.get("max_tokens") or 4)
        if b.first_chunk_delay_s:
            await asyncio.sleep(b.first_chunk_delay_s)
        if body.get("stream") is True:
            return await self._stream(request, body, rid, chat, n)
        text = "".join(f" t{i}" for i in range(n))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = "length"
        answer = {
            "id": f"cmpl-{rid}",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(n),
            "kv_transfer_params": None,
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def _usage(self, n: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        if self.behavior.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.behavior.cached_tokens}
        return usage

    def _producer_answer(self, body: dict[str, Any], rid: str, chat: bool) -> dict[str, Any]:
        kvp_in = body["kv_transfer_params"]
        kvp: dict[str, Any] | None
        if self.behavior.bad_producer_answer:
            kvp = None
        elif "remote_decoder" in kvp_in:
            kvp = {
                "remote_host": self.host,
                "remote_port": self.behavior.p2p_port,
                "kv_request_id": kvp_in["remote_decoder"]["kv_request_id"],
                "num_blocks": 2,
            }
        else:
            kvp = nixl_producer_answer(self.name, rid, self.host)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": " t0"}}
            if chat
            else {"index": 0, "text": " t0"}
        )
        choice["finish_reason"] = "length"
        return {
            "id": f"cmpl-{rid}",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(1),
            "kv_transfer_params": kvp,
        }

    async def _stream(
        self, request: web.Request, body: dict[str, Any], rid: str, chat: bool, n: int
    ) -> web.StreamResponse:
        b = self.behavior
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # vLLM opens a chat stream with the role and empty content
            await resp.write(
                f'data: {{"id":"cmpl-{rid}","object":"{obj}","model":"{self.model}",'
                f'"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                f'"finish_reason":null}}]}}\n\n'.encode()
            )
        for i in range(n):
            if b.cut_after_chunks is not None and i >= b.cut_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return resp
            if i and b.chunk_delay_s:
                await asyncio.sleep(b.chunk_delay_s)
            finish = '"length"' if i == n - 1 else "null"  # vLLM: on the last token's chunk
            piece = (
                f'{{"delta":{{"content":" t{i}"}},"index":0,"finish_reason":{finish}}}'
                if chat
                else f'{{"text":" t{i}","index":0,"finish_reason":{finish}}}'
            )
            await resp.write(
                f'data: {{"id":"cmpl-{rid}","object":"{obj}","model":"{self.model}",'
                f'"choices":[{piece}]}}\n\n'.encode()
            )
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            usage = {"id": f"cmpl-{rid}", "object": obj, "choices": [], "usage": self._usage(n)}
            await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _serve(listen: list[tuple[str, int]], behavior: Behavior) -> None:
    backends = [FakeBackend(name, behavior, port=port) for name, port in listen]
    for backend in backends:
        await backend.start()
        print(f"fake backend {backend.name} on {backend.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for backend in backends:
            await backend.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", action="append", required=True, help="NAME=PORT")
    parser.add_argument("--chunks", type=int, default=None)
    parser.add_argument("--producer-delay", type=float, default=0.0)
    parser.add_argument("--first-chunk-delay", type=float, default=0.0)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    listen = [(item.split("=")[0], int(item.split("=")[1])) for item in args.listen]
    behavior = Behavior(
        chunks=args.chunks,
        producer_delay_s=args.producer_delay,
        first_chunk_delay_s=args.first_chunk_delay,
        chunk_delay_s=args.chunk_delay,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(listen, behavior))


if __name__ == "__main__":
    main()
