"""A small real consumer engine for failover tests: a deterministic "greedy model" over raw HTTP.

The next character is a function of the whole text so far (prompt + generated), so a
continuation leg produces exactly the uninterrupted output if and only if the proxy sent exactly
the prompt plus what was generated. Chat prompts are rendered with the reference worker's
template (``continue_final_message`` leaves the last message open). Streams are shaped like
vLLM's (one token per chunk, ``stream_options`` honoured, usage chunk, ``[DONE]``).

A :class:`Fault` makes the next ``times`` streamed answers fail after ``after`` tokens:
``reset`` (connection dropped between events), ``mid_event`` (dropped in the middle of an
event), ``error_event`` (an error event, then ``[DONE]``), ``truncate`` (a clean end of the HTTP
body without ``[DONE]``), ``stall`` (nothing more is sent), ``before_usage`` (dropped after the
last token, before the usage chunk), ``mid_usage`` (dropped in the middle of the usage
chunk), ``garbage`` (an event that is not JSON: hostile).

Token ids are the text's UTF-8 bytes (the reference worker's tokenizer): ``return_token_ids``
puts them in the chunks, and the prompt's where vLLM does (chat: the role chunk's top level;
completions: the first choice); chat honours vLLM's ``kv_transfer_params.prompt_token_ids``.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

ALPHABET = "abcdefghijklmnopqrstuvwxyz ."


def next_char(text: str) -> str:
    return ALPHABET[xxhash.xxh64_intdigest(text.encode()) % len(ALPHABET)]


def greedy(prompt: str, n: int) -> str:
    """The uninterrupted answer of ``n`` tokens to ``prompt``."""
    out = ""
    for _ in range(n):
        out += next_char(prompt + out)
    return out


def render_chat(body: dict[str, Any]) -> str:
    parts = [f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in body["messages"]]
    if body.get("continue_final_message"):
        parts[-1] = parts[-1][:-1]
    elif body.get("add_generation_prompt", True):
        parts.append("<|assistant|>\n")
    return "".join(parts)


@dataclass
class Fault:
    kind: str
    after: int = 3
    times: int = 1


@dataclass
class GreedyConsumer:
    name: str
    fault: Fault | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    open_connections: int = 0
    reuses_prompt_ids: bool = True
    """Chat honours ``kv_transfer_params.prompt_token_ids`` (vLLM >= 0.32); False: ignores it."""
    server: asyncio.Server | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> GreedyConsumer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.open_connections -= 1
            writer.transport.abort()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        first, *lines = head.split(b"\r\n")
        for line in lines:
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        raw = await reader.readexactly(length)
        if first.startswith(b"GET"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            return True
        body = orjson.loads(raw)
        self.bodies.append(body)
        chat = b"/chat/" in first
        reused = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        if chat and reused is not None and self.reuses_prompt_ids:
            prompt = bytes(reused).decode()  # vLLM's decode-side token reuse
        else:
            prompt = render_chat(body) if chat else _prompt_text(body["prompt"])
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if not body.get("stream"):
            text = greedy(prompt, limit)
            answer = orjson.dumps({"choices": [{"index": 0, "text": text}]})
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            writer.write(b"content-length: %d\r\n\r\n" % len(answer) + answer)
            return True
        fault = self.fault
        if fault is not None and fault.times > 0:
            fault.times -= 1
        else:
            fault = None
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        return await self._stream(writer, body, chat, prompt, limit, fault)

    async def _stream(
        self,
        writer: asyncio.StreamWriter,
        body: dict[str, Any],
        chat: bool,
        prompt: str,
        limit: int,
        fault: Fault | None,
    ) -> bool:
        opts = body.get("stream_options") or {}
        usage_on = opts.get("include_usage") is True
        continuous = usage_on and opts.get("continuous_usage_stats") is True
        prompt_tokens = len(prompt.encode())
        ident = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{self.name}-{len(self.bodies)}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1_700_000_000 + len(self.bodies),
            "model": f"model-{self.name}",
        }

        def usage(n: int) -> dict[str, int]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                    "total_tokens": prompt_tokens + n}  # fmt: skip

        def event(payload: object) -> bytes:
            data = b"data: " + orjson.dumps(payload) + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        async def emit(data: bytes) -> None:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0)

        ids = body.get("return_token_ids") is True  # token ids: the text's bytes
        prompt_ids: list[int] | None = list(prompt.encode()) if ids else None
        if chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None}  # fmt: skip
            opening = {**ident, "choices": [choice], "usage": usage(0) if continuous else None}
            if prompt_ids is not None:
                opening["prompt_token_ids"] = prompt_ids
                prompt_ids = None
            await emit(event(opening))
        text = ""
        for i in range(limit):
            if fault is not None and i == fault.after and "usage" not in fault.kind:
                await self._fail(writer, fault, event, ident)
                return False
            char = next_char(prompt + text)
            text += char
            last = i == limit - 1
            piece: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
            if chat:
                piece["delta"] = {"content": char}
            else:
                piece["text"] = char
            if ids:
                piece["token_ids"] = list(char.encode())
            if prompt_ids is not None:
                piece["prompt_token_ids"] = prompt_ids
                prompt_ids = None
            await emit(event({**ident, "choices": [piece],
                              "usage": usage(i + 1) if continuous else None}))  # fmt: skip
        if fault is not None and fault.kind == "before_usage":
            writer.transport.abort()
            return False
        if fault is not None and fault.kind == "mid_usage":
            half = event({**ident, "choices": [], "usage": usage(limit)})[:40]
            writer.write(half)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()
            return False
        if usage_on:
            await emit(event({**ident, "choices": [], "usage": usage(limit)}))
        done = b"data: [DONE]\n\n"
        await emit(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        return True

    async def _fail(
        self, writer: asyncio.StreamWriter, fault: Fault, event: Any, ident: Any
    ) -> None:
        if fault.kind == "reset":
            writer.transport.abort()
        elif fault.kind == "mid_event":
            half = b'data: {"id": "' + ident["id"].encode()
            writer.write(b"%x\r\n%s\r\n" % (len(half), half))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()
        elif fault.kind == "error_event":
            error = {"error": {"message": "engine died", "type": "InternalServerError",
                               "param": None, "code": 500}}  # fmt: skip
            done = b"data: [DONE]\n\n"
            writer.write(event(error) + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
        elif fault.kind == "truncate":
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        elif fault.kind == "garbage":  # hostile: an event that is not JSON, then more bytes
            junk = b"data: not json\n\n" + b"x" * 1000
            writer.write(b"%x\r\n%s\r\n" % (len(junk), junk))
            await writer.drain()
            await asyncio.sleep(3600)
        elif fault.kind == "stall":
            await asyncio.sleep(3600)
        else:
            raise ValueError(fault.kind)


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return str(prompt[0])
    if isinstance(prompt, list):  # token ids: bytes, as the reference worker reads them
        return bytes(prompt).decode()
    return str(prompt)
