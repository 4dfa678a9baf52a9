"""Property fuzzing of the proxy's OpenAI front (same strategies as the worker's fuzz).

The proxy app runs in process (ASGI) in front of two small real HTTP servers (the fake engines
of ``loadtest.fake_backend``: a producer and a consumer). Every answer must be a well-formed
OpenAI error or a valid completion / complete stream — never a 500, never a hang — and client
``kv_transfer_params`` never reach an engine (the proxy refuses them for untrusted keys).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtest.fake_backend import Behavior, FakeBackend
from pdproxy.app import create_app
from pdproxy.settings import ProxySettings

from .http_strategies import CHAT_BODY, COMPLETION_BODY, HEADERS, RAW_BODY, encode_body
from .openai_shape import ANSWER_TIMEOUT_S, check_answer, post_and_classify
from .record import Tally, long_mode


class _Front:
    def __init__(self, client: httpx.AsyncClient, backends: list[FakeBackend]) -> None:
        self.client = client
        self.backends = backends
        self.kinds: dict[str, int] = {}

    async def send(self, path: str, content: bytes, headers: dict[str, str]) -> None:
        await post_and_classify(self.client, path, content, headers, self.kinds)

    def client_params_reached_an_engine(self) -> list[Any]:
        """Consumer legs whose kv_transfer_params the proxy did not write itself."""
        leaked = []
        for b in self.backends:
            for rec in b.completions():
                body = rec.json()
                params = body.get("kv_transfer_params") if isinstance(body, dict) else None
                if b.name == "d" and params is not None and "remote_prefiller" not in params:
                    leaked.append(params)
        return leaked


async def _front() -> AsyncGenerator[_Front, None]:
    # The fake consumer answers 3 tokens whatever max_tokens says (a real engine refuses a
    # max_tokens beyond its context; the fake would stream forever).
    async with FakeBackend("p") as p, FakeBackend("d", Behavior(chunks=3)) as d:
        proxy_settings = ProxySettings.model_validate(
            {
                "backends": [
                    {"name": "p", "url": p.url, "role": "producer", "dialect": "p2p"},
                    {"name": "d", "url": d.url, "role": "consumer", "dialect": "p2p"},
                ],
                "health": {"enabled": False},
                "admission": {"max_body_bytes": 1_000_000},
            }
        )
        app = create_app(proxy_settings)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
                yield _Front(client, [p, d])


_FUZZ = settings(
    max_examples=1500 if long_mode() else 120,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.filter_too_much,
    ],
    database=None,
)


def _run(
    tally: Tally, path: str, examples: st.SearchStrategy[tuple[bytes, dict[str, str]]]
) -> None:
    loop = asyncio.new_event_loop()
    gen = _front()
    front = loop.run_until_complete(anext(gen))

    @_FUZZ
    @given(examples)
    def check(example: tuple[bytes, dict[str, str]]) -> None:
        content, headers = example
        try:
            loop.run_until_complete(front.send(path, content, headers))
        except (AssertionError, TimeoutError) as exc:
            tally.fail(f"{type(exc).__name__}: {str(exc)[:200]}")
            raise
        tally.ok()

    try:
        check()
        leaked = front.client_params_reached_an_engine()
    finally:
        loop.run_until_complete(gen.aclose())
        loop.close()
    tally.notes.append(f"answers: {dict(sorted(front.kinds.items()))}")
    assert not leaked, f"client kv_transfer_params reached the consumer: {leaked[:3]}"
    assert front.kinds.get("error", 0) > 0


def test_fuzz_proxy_completions(tally: Tally) -> None:
    _run(tally, "/v1/completions", st.tuples(COMPLETION_BODY.map(encode_body), HEADERS))


def test_fuzz_proxy_chat(tally: Tally) -> None:
    _run(tally, "/v1/chat/completions", st.tuples(CHAT_BODY.map(encode_body), HEADERS))


def test_fuzz_proxy_raw_bodies(tally: Tally) -> None:
    _run(tally, "/v1/completions", st.tuples(RAW_BODY, HEADERS))


async def test_fuzz_proxy_big_int_with_lone_surrogate(tally: Tally) -> None:
    gen = _front()
    front = await anext(gen)
    try:
        content = b'{"prompt": "\\ud800", "max_tokens": 2, "n": 10000000000000000000000}'
        await front.send("/v1/completions", content, {})
        assert front.kinds == {"error": 1}, front.kinds
        tally.ok()
    finally:
        await gen.aclose()


@pytest.mark.parametrize("size", [1_000_001, 8_000_000])
async def test_fuzz_proxy_oversize_body(size: int, tally: Tally) -> None:
    gen = _front()
    front = await anext(gen)
    try:
        body = encode_body({"prompt": "x" * size, "max_tokens": 1})
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            resp = await front.client.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
        assert resp.status_code == 413, resp.status_code
        check_answer(
            resp.status_code, resp.content, resp.headers.get("content-type", ""), chat=False
        )
        tally.ok()
    finally:
        await gen.aclose()
