"""PD output equals single-node output token for token (both dialects, both backends)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .pd_helpers import assert_released, connector, pd_request, workers

SYSTEM_A = "You are the reference worker. Answer briefly and exactly. " * 4  # 236 tokens
SYSTEM_B = "System prompt B: the producer has served this one before. " * 4


def prompts() -> dict[str, str]:
    long = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(7))
    return {
        "short": "Hi!",
        "one_block_minus_one": "x" * 15,
        "block_aligned": "b" * 64,
        "block_aligned_plus_one": "c" * 65,
        "long_crossing_window": long,
        "consumer_has_prefix": SYSTEM_A + "What is a block?",
        "producer_has_prefix": SYSTEM_B + "What is a page?",
    }


async def single_node(single: Any, body: dict[str, Any]) -> list[int]:
    resp = await single.client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    ids: list[int] = resp.json()["choices"][0]["token_ids"]
    return ids


@pytest.mark.parametrize("dialect", ["p2p", "nixl"])
@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_pd_equals_single_node(model: str, dialect: str) -> None:
    await check_equivalence(model, dialect)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_pd_equals_single_node_on_cuda(model: str) -> None:
    await check_equivalence(model, "nixl", device="cuda")


async def check_equivalence(model: str, dialect: str, **overrides: Any) -> None:
    roles = ("producer", "consumer", "both")
    async with workers(model, *roles, **overrides) as (producer, consumer, single):
        base = {"max_tokens": 10, "temperature": 0, "return_token_ids": True}
        # Prefixes already cached on one side only: that side served a shorter prompt before.
        for w, system in ((consumer, SYSTEM_A), (producer, SYSTEM_B)):
            prefix = {**base, "prompt": system + "Hello", "max_tokens": 2}
            assert (await w.client.post("/v1/completions", json=prefix)).status_code == 200
        for name, prompt in prompts().items():
            body = {**base, "prompt": prompt}
            expected = await single_node(single, body)
            result = await pd_request(producer, consumer, body, dialect)
            assert result.token_ids == expected, name
            usage = result.consumer["usage"]
            n = len(prompt.encode())
            assert usage["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16, name
        stats = consumer.worker.stats
        assert stats.recomputed_tokens == 0 and stats.p2p_fetch_failures == 0
        assert stats.kv_params_fallbacks == 0 and stats.p2p_blocks_fetched > 0
        assert_released(producer, consumer)


@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_pd_streaming_chat_equals_single_node(model: str) -> None:
    async with workers(model, "producer", "consumer", "both") as (producer, consumer, single):
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM_A},
                {"role": "user", "content": "Count to three."},
            ],
            "max_tokens": 8,
            "temperature": 0,
        }
        expected = (await single.client.post("/v1/chat/completions", json=body)).json()
        text = expected["choices"][0]["message"]["content"]
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        result = await _pd_stream(producer, consumer, stream_body)
        assert result == text
        assert consumer.worker.stats.recomputed_tokens == 0
        assert_released(producer, consumer)


async def _pd_stream(producer: Any, consumer: Any, body: dict[str, Any]) -> str:
    import json

    leg = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"remote_decoder": {"kv_request_id": "stream-k"}},
    }
    leg.pop("stream_options")
    answer = (await producer.client.post("/v1/chat/completions", json=leg)).json()
    params = answer["kv_transfer_params"]
    consumer_body = {
        **body,
        "kv_transfer_params": {
            "remote_prefiller": {
                "kv_request_id": params["kv_request_id"],
                "remote_host": params["remote_host"],
                "remote_port": params["remote_port"],
            }
        },
    }
    text = ""
    async with consumer.client.stream("POST", "/v1/chat/completions", json=consumer_body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content", "")
    return text


@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_concurrent_shared_prefix_burst(model: str) -> None:
    async with workers(model, "producer", "consumer", "both") as (producer, consumer, single):
        bodies = [
            {
                "prompt": SYSTEM_A + f"Question {i}: what comes after {i}?",
                "max_tokens": 6,
                "temperature": 0,
                "return_token_ids": True,
            }
            for i in range(12)
        ]
        expected = [await single_node(single, b) for b in bodies]
        results = await asyncio.wait_for(
            asyncio.gather(*(pd_request(producer, consumer, b, "p2p") for b in bodies)), 60
        )
        assert [r.token_ids for r in results] == expected
        stats = consumer.worker.stats
        assert stats.p2p_fetch_failures == 0 and stats.recomputed_tokens == 0
        # Producer legs finishing together: later ones found the shared prefix's host pages
        # still being written (HIT_PENDING), were parked, and were served when the write
        # completed (vLLM #53062).
        assert connector(producer).manager.stats().unparked > 0
        assert_released(producer, consumer)
