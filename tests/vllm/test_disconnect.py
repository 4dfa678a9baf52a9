"""A client that leaves mid-stream leaves no running request on either vLLM instance."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.vllm.conftest import MODEL, VllmStack, prompt_ids, vllm_metric

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

IDLE_WITHIN_S = 10.0
"""Product promise: both legs are cancelled within a few seconds (generous: 2 shared cores)."""


def _busy(url: str) -> float:
    return vllm_metric(url, "vllm:num_requests_running") + vllm_metric(
        url, "vllm:num_requests_waiting"
    )


def test_client_gone_mid_stream_cancels_both_legs(vllm_stack: VllmStack) -> None:
    body = {
        "model": MODEL,
        "prompt": prompt_ids(100, 300),
        "max_tokens": 1500,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=180) as client,
        client.stream("POST", vllm_stack.pd_url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        # Read until the consumer's own metrics show it decoding for us (bounded: 1500 tokens
        # take far longer than the 200 chunks allowed here), then leave mid-stream.
        chunks = 0
        decoding = False
        first_events: list[str] = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks += 1
                if len(first_events) < 4:
                    first_events.append(line[:300])
            if chunks and chunks % 5 == 0:
                decoding = _busy(vllm_stack.url("d0")) >= 1
            if decoding or chunks >= 200:
                break
        assert decoding, (
            f"d0 never showed a running request in {chunks} chunks: {first_events} "
            f"(logs in {vllm_stack.log_dir})"
        )
    deadline = time.monotonic() + IDLE_WITHIN_S
    while time.monotonic() < deadline:
        if _busy(vllm_stack.url("d0")) == 0 and _busy(vllm_stack.url("p0")) == 0:
            break
        time.sleep(0.2)
    assert _busy(vllm_stack.url("d0")) == 0
    assert _busy(vllm_stack.url("p0")) == 0
