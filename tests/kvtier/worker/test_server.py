"""The OpenAI endpoints of a single worker, in process over ASGI."""

from __future__ import annotations

import json

import pytest

from .conftest import running_worker, small_settings

PROMPT = "Tell me a story about a block of sixteen tokens. " * 3


def sse_events(raw: str) -> list[dict[str, object] | str]:
    events: list[dict[str, object] | str] = []
    for line in raw.split("\n\n"):
        if not line.strip():
            continue
        assert line.startswith("data: ")
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_completion_usage_and_cached_tokens(model: str) -> None:
    async with running_worker(small_settings(model=model)) as w:
        body = {"model": f"kvtier-{model}", "prompt": PROMPT, "max_tokens": 7, "temperature": 0}
        first = await w.client.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        data = first.json()
        assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
        choice = data["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["text"]) == 7
        usage = data["usage"]
        n = len(PROMPT.encode())
        assert usage == {
            "prompt_tokens": n,
            "completion_tokens": 7,
            "total_tokens": n + 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        second = (await w.client.post("/v1/completions", json=body)).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
        assert second["choices"][0]["text"] == choice["text"]


async def test_completion_accepts_token_ids_and_returns_them() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        body = {
            "prompt": list(PROMPT.encode()),
            "max_tokens": 5,
            "temperature": 0,
            "return_token_ids": True,
        }
        data = (await w.client.post("/v1/completions", json=body)).json()
        text = data["choices"][0]["text"]
        assert data["choices"][0]["token_ids"] == list(text.encode())
        by_text = (await w.client.post("/v1/completions", json={**body, "prompt": PROMPT})).json()
        assert by_text["choices"][0]["text"] == text


async def test_stream_completion_with_usage_matches_non_stream() -> None:
    async with running_worker(small_settings(model="tiny")) as w:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        plain = (await w.client.post("/v1/completions", json=body)).json()
        resp = await w.client.post(
            "/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict)]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])  # type: ignore[index]
        assert text == plain["choices"][0]["text"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6  # type: ignore[index]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


async def test_chat_stream_and_non_stream() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        body = {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
            "max_completion_tokens": 5,
            "temperature": 0,
        }
        plain = (await w.client.post("/v1/chat/completions", json=body)).json()
        assert plain["object"] == "chat.completion"
        message = plain["choices"][0]["message"]
        assert message["role"] == "assistant" and len(message["content"]) == 5
        resp = await w.client.post("/v1/chat/completions", json={**body, "stream": True})
        events = sse_events(resp.text)
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])  # type: ignore[index,union-attr]
        assert content == message["content"]
        assert all(c["usage"] is None for c in chunks)  # no include_usage


async def test_continuous_usage_stats() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        resp = await w.client.post(
            "/v1/completions",
            json={
                "prompt": "hello",
                "max_tokens": 3,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
        chunks = [e for e in sse_events(resp.text) if isinstance(e, dict)]
        assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]  # type: ignore[index]


async def test_models_health_metrics() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        models = (await w.client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "kvtier-sim"
        assert (await w.client.get("/health")).status_code == 200
        await w.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        await w.client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        text = (await w.client.get("/metrics")).text
        assert "kvtier_worker_running_requests 0.0" in text
        assert 'kvtier_worker_kv_usage_ratio{group="0"}' in text
        assert "kvtier_worker_prefix_hit_tokens_total 144.0" in text
        assert "kvtier_worker_recomputed_tokens_total 0.0" in text
        assert "kvtier_worker_p2p_bytes_fetched_total 0.0" in text


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt"),
        ("/v1/completions", {"prompt": [1, 99999]}, "token ids"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "role"),
        ("/v1/completions", {"prompt": "x" * 1100, "max_tokens": 1}, "maximum context length"),
        ("/v1/completions", {"prompt": "x" * 1000, "max_tokens": 100}, "maximum context length"),
    ],
)
async def test_bad_requests_get_openai_shaped_400s(
    path: str, body: dict[str, object], needle: str
) -> None:
    async with running_worker(small_settings(model="sim")) as w:
        resp = await w.client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert needle in error["message"]
        assert error["type"] == "BadRequestError" and error["code"] == 400


async def test_invalid_json_and_unknown_model() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        resp = await w.client.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert resp.status_code == 400 and "error" in resp.json()
        resp = await w.client.post("/v1/completions", json={"prompt": "x", "model": "other"})
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"


async def test_request_id_header_names_the_response() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        resp = await w.client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"X-Request-Id": "abc123"},
        )
        assert resp.json()["id"] == "cmpl-abc123"
