"""PD through pdproxy (vLLM producer → NIXL → vLLM consumer) yields exactly a single vLLM node's
greedy output, and the consumer really took the prompt's KV from the producer."""

from __future__ import annotations

import httpx
import pytest

from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE
from tests.vllm.conftest import (
    MODEL,
    VllmStack,
    drift_buckets,
    prompt_ids,
    route_of,
    vllm_metric,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


def _complete(url: str, prompt: object, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.parametrize(
    ("seed", "length"),
    [
        (1, 40),  # shorter than a block: only a partial block to move
        (2, VLLM_BLOCK_SIZE),  # exactly one block
        (3, 2 * VLLM_BLOCK_SIZE + 45),  # longer than a block, not block-aligned
        (4, 5 * VLLM_BLOCK_SIZE + 1),
    ],
)
def test_pd_equals_single_node_token_prompts(vllm_stack: VllmStack, seed: int, length: int) -> None:
    prompt = prompt_ids(seed, length)
    drift_before = drift_buckets(vllm_stack.pd_url, "pd")
    hits_before = vllm_metric(vllm_stack.url("d0"), EXTERNAL_HITS)
    pd = _complete(vllm_stack.pd_url, prompt, {"x-pdproxy-debug": "1"})
    hits = vllm_metric(vllm_stack.url("d0"), EXTERNAL_HITS) - hits_before
    single = _complete(vllm_stack.url("r0"), prompt)

    assert "producer" in pd.headers["server-timing"]  # both legs ran
    assert "x-pdproxy-fallback" not in pd.headers
    assert route_of(pd)["producers"]
    got, want = pd.json(), single.json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == length
    # The whole prompt came over NIXL: vLLM counts every prompt token as an external
    # prefix-cache hit on the consumer, the partial last block included.
    assert hits == length
    # ... and reports none of them as cached: usage counts only its own prefix-cache hits, which
    # is what the router predicts for vLLM (pd_cached_tokens: consumer_local): drift zero.
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    drift = drift_buckets(vllm_stack.pd_url, "pd")
    observed = drift["+Inf"] - drift_before.get("+Inf", 0.0)
    assert observed == 1
    assert drift["0.0"] - drift_before.get("0.0", 0.0) == 1
    assert drift["-1.0"] - drift_before.get("-1.0", 0.0) == 0


def test_pd_equals_single_node_text_and_chat(vllm_stack: VllmStack) -> None:
    text = "Garden river mountain window, paper music light. " * 30
    pd = _complete(vllm_stack.pd_url, text)
    single = _complete(vllm_stack.url("r0"), text)
    assert pd.json()["choices"][0]["token_ids"] == single.json()["choices"][0]["token_ids"]

    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Explain prefix caching. " * 20}],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    a = httpx.post(vllm_stack.pd_url + "/v1/chat/completions", json=chat, timeout=180)
    b = httpx.post(vllm_stack.url("r0") + "/v1/chat/completions", json=chat, timeout=180)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]
