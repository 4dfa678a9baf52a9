"""A tiny OpenAI-compatible server for load-generator tests (run as a subprocess).

    python tests/loadtest/fake_openai.py --port 8123 [--token-delay 0.002]

The answer is ``max_tokens`` tokens `` t0 t1 ...``; the request's ``model`` picks a behaviour:
``fail-500`` answers 500, ``fail-429`` answers 429, ``stream-error`` sends an error object
inside a 200 stream, ``cut`` closes the stream without ``[DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web


def _chunk(kind: str, text: str, usage: dict[str, int] | None = None) -> bytes:
    if kind == "chat":
        choice: dict[str, object] = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": None}
        obj = "text_completion"
    doc: dict[str, object] = {"id": "x", "object": obj, "created": int(time.time())}
    doc["choices"] = [choice] if text else []
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def make_app(token_delay: float) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        kind = "chat" if request.path.endswith("chat/completions") else "completions"
        body = await request.json()
        model = str(body.get("model", ""))
        if model in ("fail-500", "fail-429"):
            status = 500 if model == "fail-500" else 429
            err = {"message": "injected", "type": "server_error", "code": status}
            return web.json_response({"error": err}, status=status)
        n = int(body.get("max_tokens") or 16)
        if kind == "chat":
            prompt = "".join(str(m.get("content", "")) for m in body.get("messages", []))
        else:
            prompt = str(body.get("prompt", ""))
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
        tokens = [f" t{i}" for i in range(n)]
        if not body.get("stream"):
            await asyncio.sleep(token_delay * n)
            text = "".join(tokens)
            if kind == "chat":
                message = {"role": "assistant", "content": text}
                choice: dict[str, object] = {"index": 0, "message": message}
            else:
                choice = {"index": 0, "text": text}
            return web.json_response({"id": "x", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, token in enumerate(tokens):
            await asyncio.sleep(token_delay)
            if model == "stream-error" and i == 1:
                await resp.write(b'data: {"error": {"message": "boom", "code": 500}}\n\n')
                break
            if model == "cut" and i == 1:
                await resp.write(_chunk(kind, token))
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(_chunk(kind, token))
        if body.get("stream_options", {}).get("include_usage"):
            await resp.write(_chunk(kind, "", usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-delay", type=float, default=0.002)
    args = parser.parse_args()
    web.run_app(make_app(args.token_delay), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
