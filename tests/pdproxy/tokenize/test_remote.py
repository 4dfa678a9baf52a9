"""The backend ``/tokenize`` tokenizer against a small real HTTP server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from pdproxy.settings.routing import TokenizerKind, TokenizerSettings
from pdproxy.tokenize.build import build_tokenizer
from pdproxy.tokenize.errors import TokenizerUnavailable
from pdproxy.tokenize.prompt import ChatPrompt, TextPrompt, prompt_of


class FakeEngine:
    """Answers ``/tokenize`` like vLLM: UTF-8 bytes, plus a marker per message for chat."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.mode = "ok"

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.mode == "slow":
            await asyncio.sleep(0.6)
        if self.mode == "error":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "garbage":
            return web.json_response({"tokens": ["a"]})
        if "messages" in body:
            tokens = [t for m in body["messages"] for t in [1000, *m["content"].encode()]]
        else:
            tokens = list(body["prompt"].encode())
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    app = web.Application()
    app.router.add_post("/tokenize", fake.tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield fake, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_text_and_chat_go_to_the_backend(engine: tuple[FakeEngine, str]) -> None:
    fake, url = engine
    tok = build_tokenizer(
        TokenizerSettings(kind=TokenizerKind.BACKEND, model="m", timeout_s=1), backend_url=url
    )
    try:
        assert list(await tok.tokenize(TextPrompt("ab", add_special_tokens=False))) == [97, 98]
        assert fake.bodies[-1] == {"model": "m", "prompt": "ab", "add_special_tokens": False}
        prompt = prompt_of(
            "chat",
            {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"k": 1}},
        )
        assert isinstance(prompt, ChatPrompt)
        assert list(await tok.tokenize(prompt)) == [1000, 97]
        sent = fake.bodies[-1]
        assert sent["messages"] == [{"role": "user", "content": "a"}]
        assert sent["add_generation_prompt"] is True and sent["chat_template_kwargs"] == {"k": 1}
    finally:
        await tok.close()


@pytest.mark.parametrize("mode", ["slow", "error", "garbage"])
async def test_backend_failures_are_typed_and_bounded(
    engine: tuple[FakeEngine, str], mode: str
) -> None:
    fake, url = engine
    fake.mode = mode
    tok = build_tokenizer(TokenizerSettings(kind=TokenizerKind.BACKEND, url=url, timeout_s=0.2))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        with pytest.raises(TokenizerUnavailable):
            await tok.tokenize(TextPrompt("ab"))
    finally:
        await tok.close()
    assert loop.time() - t0 < 1.5


async def test_unreachable_backend_is_unavailable() -> None:
    tok = build_tokenizer(
        TokenizerSettings(kind=TokenizerKind.BACKEND, url="http://127.0.0.1:9", timeout_s=0.5)
    )
    try:
        with pytest.raises(TokenizerUnavailable):
            await tok.tokenize(TextPrompt("ab"))
    finally:
        await tok.close()
