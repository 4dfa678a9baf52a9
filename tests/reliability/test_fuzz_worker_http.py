"""Property fuzzing of the worker's OpenAI endpoints (bad input, §"Bad input" of the issue).

Every answer must be a well-formed OpenAI error or a valid completion / complete stream — never a
500, never a hang — and the worker must be idle again afterwards (no page, supply or request
left behind). The worker runs in process (ASGI) so that hypothesis can send hundreds of bodies
within seconds; ``test_worker_process_survives_hostile_http`` repeats the worst cases against a
real process over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings

from .http_strategies import CHAT_BODY, COMPLETION_BODY, HEADERS, JSON_VALUE, RAW_BODY, encode_body
from .openai_shape import ANSWER_TIMEOUT_S, check_answer, post_and_classify
from .record import Tally, long_mode

# -- the worker under test -------------------------------------------------------------------------


def _settings() -> WorkerSettings:
    return WorkerSettings(
        model="sim",
        role="both",
        num_pages=96,
        host_pages=96,
        max_model_len=256,
        default_max_tokens=8,
        fetch_timeout_s=2.0,
        supply_lease_s=5.0,
        p2p_port=0,
    )


class _Fuzzed:
    """One in-process worker shared by the examples of a test."""

    def __init__(self, client: httpx.AsyncClient, app: Any) -> None:
        self.client = client
        self.app = app
        self.kinds: dict[str, int] = {}

    async def send(self, path: str, content: bytes, headers: dict[str, str]) -> None:
        await post_and_classify(self.client, path, content, headers, self.kinds)

    async def assert_idle(self) -> None:
        worker = self.app.state.worker
        for _ in range(100):
            engine = worker.engine
            if engine.num_running == 0 and engine.num_waiting == 0:
                break
            await asyncio.sleep(0.02)
        assert worker.engine.num_running == 0 and worker.engine.num_waiting == 0
        for pool in worker.engine.kv.pools:
            assert pool.refcounts() == [0] * pool.num_pages, "device pages left referenced"
        conn = worker.connector
        assert conn.pool.stats().referenced == 0, "host pages left referenced"
        assert conn.manager.stats().requests == 0, "offload requests left open"


async def _fuzzed() -> AsyncGenerator[_Fuzzed, None]:
    app = create_app(_settings())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            yield _Fuzzed(client, app)


_FUZZ = settings(
    max_examples=1500 if long_mode() else 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


def _run_examples(
    tally: Tally,
    path: str,
    examples: st.SearchStrategy[tuple[bytes, dict[str, str]]],
    *,
    expect_answers: bool = True,
) -> None:
    loop = asyncio.new_event_loop()
    gen = _fuzzed()
    fuzzed = loop.run_until_complete(anext(gen))
    failures: list[str] = []

    @_FUZZ
    @given(examples)
    def check(example: tuple[bytes, dict[str, str]]) -> None:
        content, headers = example
        try:
            loop.run_until_complete(fuzzed.send(path, content, headers))
        except (AssertionError, TimeoutError) as exc:
            tally.fail(f"{type(exc).__name__}: {str(exc)[:200]}")
            failures.append(str(exc))
            raise
        tally.ok()

    try:
        check()
        loop.run_until_complete(fuzzed.assert_idle())
    finally:
        loop.run_until_complete(gen.aclose())
        loop.close()
    assert not failures
    tally.notes.append(f"answers: {dict(sorted(fuzzed.kinds.items()))}")
    # Not vacuous: the fuzz reached the engine (valid answers) as well as the error paths.
    assert fuzzed.kinds.get("error", 0) > 0, fuzzed.kinds
    if expect_answers:
        assert fuzzed.kinds.get("ok", 0) + fuzzed.kinds.get("stream", 0) > 10, fuzzed.kinds


def test_fuzz_worker_completions_bodies(tally: Tally) -> None:
    examples = st.tuples(COMPLETION_BODY.map(encode_body), HEADERS)
    _run_examples(tally, "/v1/completions", examples)


def test_fuzz_worker_chat_bodies(tally: Tally) -> None:
    examples = st.tuples(CHAT_BODY.map(encode_body), HEADERS)
    _run_examples(tally, "/v1/chat/completions", examples)


def test_fuzz_worker_raw_bodies(tally: Tally) -> None:
    examples = st.tuples(st.one_of(RAW_BODY, JSON_VALUE.map(encode_body)), HEADERS)
    _run_examples(tally, "/v1/completions", examples, expect_answers=False)


# Bodies that once made the worker answer 500 (each is a regression case of a fixed bug).
_ONCE_FATAL = [
    ("/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616, "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "x", "seed": -9223372036854775809, "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "x", "cache_salt": "\\ud800", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "x", "model": "\\ud800"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\ud800", "content": "x"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "\\ud800": 1}'),
    (
        "/v1/completions",
        b'{"prompt": "x", "max_tokens": 2, '
        b'"kv_transfer_params": {"remote_decoder": {"kv_request_id": "\\ud800"}}}',
    ),
]


@pytest.mark.parametrize(("path", "content"), _ONCE_FATAL)
async def test_fuzz_worker_regressions(path: str, content: bytes, tally: Tally) -> None:
    gen = _fuzzed()
    fuzzed = await anext(gen)
    try:
        await fuzzed.send(path, content, {"content-type": "application/json"})
        tally.ok()
        await fuzzed.assert_idle()
    finally:
        await gen.aclose()


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/kv/release", "/v1/models"]
)
async def test_fuzz_worker_oversize_and_odd_requests(path: str, tally: Tally) -> None:
    """Oversize bodies and wrong methods: an error answer, never a 500 or a hang."""
    gen = _fuzzed()
    fuzzed = await anext(gen)
    try:
        huge_prompt = encode_body({"prompt": "x" * 4_000_000, "max_tokens": 4})
        huge_ids = encode_body({"prompt": list(range(200)) * 5000, "max_tokens": 4})
        deep = encode_body(
            {"messages": [{"role": "user", "content": "a"}] * 20000, "max_tokens": 2}
        )
        for content in (huge_prompt, huge_ids, deep, b"x" * 2_000_000):
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                resp = await fuzzed.client.post(
                    path, content=content, headers={"content-type": "application/json"}
                )
            if path == "/v1/models":
                assert resp.status_code == 405
            else:
                assert check_answer(
                    resp.status_code, resp.content, resp.headers.get("content-type", ""),
                    chat="chat" in path,
                ) == "error"  # fmt: skip
            tally.ok()
        await fuzzed.assert_idle()
    finally:
        await gen.aclose()
