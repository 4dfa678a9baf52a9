"""The worker's HTTP gate, played by an attacker: no key, a wrong key, huge ids, huge bodies.

Each test sends what a hostile client on the worker's network would send and checks both the
answer and that nothing happened behind it (no supply released, no supply opened, no body read).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import SecretStr
from starlette.types import Message

from kvtier.worker.server.access import WorkerGate
from kvtier.worker.stats import EngineStats

from .conftest import RunningWorker, running_worker, small_settings
from .pd_helpers import connector

KEY = "worker-key-" + uuid.uuid4().hex
PROMPT = "A prompt long enough to fill a few sixteen-token blocks of KV. " * 2
AUTH = {"authorization": f"Bearer {KEY}"}


def _keyed(**overrides: Any) -> Any:
    return running_worker(small_settings(model="sim", api_key=KEY, **overrides))


async def _producer_leg(w: RunningWorker, headers: dict[str, str]) -> str:
    kv_request_id = uuid.uuid4().hex
    body = {
        "prompt": PROMPT,
        "max_tokens": 1,
        "kv_transfer_params": {"remote_decoder": {"kv_request_id": kv_request_id}},
    }
    resp = await w.client.post("/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["kv_transfer_params"]["kv_request_id"] == kv_request_id
    return kv_request_id


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": f"Basic {KEY}"},
        {"authorization": KEY},
        {"authorization": f"Bearer {KEY}x"},
        {"authorization": f"Bearer {KEY[:-1]}"},
    ],
    ids=["none", "wrong", "basic-scheme", "no-scheme", "longer", "prefix"],
)
async def test_every_route_but_health_and_metrics_needs_the_key(headers: dict[str, str]) -> None:
    async with _keyed() as w:
        kv_request_id = await _producer_leg(w, AUTH)
        conn = connector(w)
        assert conn.registry.stats().requests == 1
        plain = {"prompt": PROMPT, "max_tokens": 2}
        attempts = [
            ("POST", "/v1/completions", plain),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("POST", "/v1/kv/release", {"kv_request_id": kv_request_id}),
            ("GET", "/v1/models", None),
            ("GET", "/no/such/route", None),
        ]
        for method, path, body in attempts:
            resp = await w.client.request(method, path, json=body, headers=headers)
            assert resp.status_code == 401, (path, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
            assert resp.json()["error"]["type"] == "AuthenticationError"
            assert KEY not in resp.text
        # The refused release changed nothing: the supply is still held.
        assert conn.registry.stats().requests == 1
        assert w.worker.stats.unauthorized_requests == len(attempts)
        assert w.worker.stats.prompt_tokens == len(PROMPT.encode())  # only the keyed leg ran
        assert (await w.client.get("/health", headers=headers)).status_code == 200
        metrics = await w.client.get("/metrics", headers=headers)
        assert metrics.status_code == 200
        assert f"kvtier_worker_unauthorized_requests_total {len(attempts)}.0" in metrics.text
        # With the key, the same release works.
        resp = await w.client.post(
            "/v1/kv/release", json={"kv_request_id": kv_request_id}, headers=AUTH
        )
        assert resp.json() == {"kv_request_id": kv_request_id, "released": True}
        assert conn.registry.stats().requests == 0


async def test_without_a_key_the_worker_trusts_its_network() -> None:
    async with running_worker(small_settings(model="sim")) as w:
        kv_request_id = await _producer_leg(w, {})
        resp = await w.client.post("/v1/kv/release", json={"kv_request_id": kv_request_id})
        assert resp.json()["released"] is True


async def test_oversized_ids_are_refused_before_anything_keeps_them() -> None:
    """The finding: 20 releases with 5 MiB ids kept +190 MiB until 4,096 newer releases. Now
    such ids never reach the supply registry (its released-id memory holds at most 4,096 ids of
    at most 256 characters)."""
    huge = "k" * (5 * 1024 * 1024)
    async with _keyed() as w:
        conn = connector(w)
        for _ in range(20):
            resp = await w.client.post("/v1/kv/release", json={"kv_request_id": huge}, headers=AUTH)
            assert resp.status_code == 400, resp.text[:200]
            assert len(resp.content) < 1024  # the id is not echoed back
        legs: list[dict[str, Any]] = [
            {"remote_decoder": {"kv_request_id": huge}},
            {"remote_prefiller": {"kv_request_id": huge, "remote_host": "127.0.0.1",
                                  "remote_port": 5600}},
            {"remote_prefiller": {"kv_request_id": "k", "remote_host": "h" * 300,
                                  "remote_port": 5600}},
            {"do_remote_prefill": True, "remote_request_id": huge, "remote_host": "127.0.0.1",
             "remote_port": 5600, "remote_engine_id": "e", "remote_block_ids": [1]},
        ]  # fmt: skip
        for params in legs:
            body = {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": params}
            resp = await w.client.post("/v1/completions", json=body, headers=AUTH)
            assert resp.status_code == 400, resp.text[:200]
            assert resp.json()["error"]["param"] == "kv_transfer_params"
            assert len(resp.content) < 1024
        assert w.worker.stats.kv_params_refused == len(legs)
        assert w.worker.stats.prompt_tokens == 0  # nothing ran
        assert conn.registry.stats().requests == 0
        resp = await w.client.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 1},
            headers={**AUTH, "x-request-id": "r" * 257},
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-request-id"


async def test_an_id_at_the_cap_is_accepted() -> None:
    async with _keyed() as w:
        resp = await w.client.post(
            "/v1/kv/release", json={"kv_request_id": "k" * 256}, headers=AUTH
        )
        assert resp.json() == {"kv_request_id": "k" * 256, "released": False}


async def test_declared_and_streamed_bodies_over_the_limit_get_413() -> None:
    async with _keyed(max_body_bytes=4096) as w:
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        resp = await w.client.post("/v1/completions", json=big, headers=AUTH)
        assert resp.status_code == 413, resp.text

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'", "max_tokens": 1}'

        resp = await w.client.post(
            "/v1/completions",
            content=chunks(),
            headers={**AUTH, "content-type": "application/json"},
        )
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == 413
        assert w.worker.stats.oversized_bodies == 2
        assert w.worker.stats.prompt_tokens == 0
        ok = await w.client.post(
            "/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1}, headers=AUTH
        )
        assert ok.status_code == 200


async def test_a_declared_huge_body_is_refused_without_reading_a_byte() -> None:
    """An attacker announces 1 GiB: the gate answers from the headers alone."""
    reads: list[Message] = []
    sent: list[Message] = []
    app_called = False

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal app_called
        app_called = True

    async def receive() -> Message:
        message: Message = {"type": "http.request", "body": b"x" * 65536, "more_body": True}
        reads.append(message)
        return message

    async def send(message: Message) -> None:
        sent.append(message)

    gate = WorkerGate(app, api_key=SecretStr(KEY), max_body_bytes=4096, stats=EngineStats())
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"authorization", AUTH["authorization"].encode()),
                    (b"content-length", str(1 << 30).encode())],
    }  # fmt: skip
    await gate(scope, receive, send)
    assert not reads and not app_called
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
