"""A producer killed outright: the proxy falls back to the consumer alone, output unchanged.

Runs last in this package (the ``kills_producer`` fixture): p0 stays dead afterwards."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.vllm.conftest import MODEL, VllmStack, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_killed_producer_falls_back_to_consumer(kills_producer: VllmStack) -> None:
    stack = kills_producer
    producer = stack.child("p0")
    producer.signal_group(signal.SIGKILL)
    assert producer.wait(deadline=float("inf")) is not None
    body = {
        "model": MODEL,
        "prompt": prompt_ids(400, 300),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(stack.pd_url + "/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    assert resp.headers.get("x-pdproxy-fallback") == "consumer-only"
    single = httpx.post(stack.url("r0") + "/v1/completions", json=body, timeout=180)
    assert resp.json()["choices"][0]["token_ids"] == single.json()["choices"][0]["token_ids"]
