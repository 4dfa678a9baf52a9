"""KV events from real vLLM: their wire shape, and the KV router acting on them.

r0 and d0 form one aggregated pool behind the ``agg`` proxy; predictions written at routing
time expire after 50 ms there, so a routing choice made later comes from vLLM's events alone.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvtier.events import BlockStored, EventBatch, EventSubscriber
from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE
from tests.vllm.conftest import MODEL, VllmStack, drift_buckets, prompt_ids, route_of

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

EVENTS_WITHIN_S = 10.0


def _complete(url: str, prompt: list[int], headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=180)
    assert resp.status_code == 200, resp.text
    return resp


async def test_vllm_block_stored_events_as_the_codec_reads_them(vllm_stack: VllmStack) -> None:
    """Live and replayed: the subscriber starts after vLLM published, so it must replay."""
    prompt = prompt_ids(200, 2 * VLLM_BLOCK_SIZE + 10)
    await asyncio.to_thread(_complete, vllm_stack.url("r0"), prompt)
    r0 = vllm_stack.instances["r0"]
    batches: list[EventBatch] = []

    async def on_batch(batch: EventBatch) -> None:
        batches.append(batch)

    stored: list[BlockStored] = []
    # vLLM serves replays from its engine process; on 2 loaded cores one took over the default
    # 1 s (CI), and a timed-out replay delivers nothing. The timeout path has its own tests.
    subscriber = EventSubscriber(
        r0.events_endpoint, r0.replay_endpoint, on_batch=on_batch, replay_timeout_s=EVENTS_WITHIN_S
    )
    async with subscriber as sub:
        deadline = time.monotonic() + EVENTS_WITHIN_S
        while time.monotonic() < deadline:
            stored = [
                e
                for b in batches
                for e in b.events
                if isinstance(e, BlockStored) and list(e.token_ids) == prompt[: len(e.token_ids)]
            ]
            if stored:
                break
            await asyncio.sleep(0.1)
        assert sub.stats.malformed == 0
        assert sub.stats.replayed > 0
    assert stored, f"no BlockStored for the prompt in {len(batches)} batches"
    # vLLM stamps its rank on every batch, 0 without data parallelism (the reference worker too).
    assert {b.data_parallel_rank for b in batches} == {0}
    first = stored[0]
    assert first.parent_block_hash is None
    assert first.block_size == VLLM_BLOCK_SIZE
    assert len(first.token_ids) == len(first.block_hashes) * VLLM_BLOCK_SIZE
    assert all(isinstance(h, int) for h in first.block_hashes)
    assert first.medium == "GPU"  # even on CPU
    assert first.group_idx == 0
    assert first.extra_keys is not None and all(k is None for k in first.extra_keys)
    assert sum(len(e.block_hashes) for e in stored) == 2  # full blocks only


def test_second_request_goes_to_the_holder_and_drift_is_zero(vllm_stack: VllmStack) -> None:
    prefix = prompt_ids(300, 3 * VLLM_BLOCK_SIZE)
    # r0 computes the prefix without the proxy: only its KV events can tell the router.
    _complete(vllm_stack.url("r0"), [*prefix, *prompt_ids(301, 7)])
    b0 = drift_buckets(vllm_stack.agg_url, "alone")
    deadline = time.monotonic() + EVENTS_WITHIN_S
    question = [*prefix, *prompt_ids(302, 20)]
    while True:
        # d0 sorts before r0 and both are idle: without r0's events the router picks d0.
        resp = _complete(vllm_stack.agg_url, question, {"x-pdproxy-debug": "1"})
        route = route_of(resp)
        chosen = route["consumers"][0]  # type: ignore[index]
        if chosen["name"] == "r0" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        question = [*prefix, *prompt_ids(int(time.monotonic() * 1000), 20)]
    assert chosen["name"] == "r0", route
    assert route["reason"] == "kv-prefix", route
    assert chosen["gpu"] == 3, route
    cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 3 * VLLM_BLOCK_SIZE
    b1 = drift_buckets(vllm_stack.agg_url, "alone")
    observed = b1["+Inf"] - b0.get("+Inf", 0.0)
    assert observed >= 1
    # Every observation of this test fell in (-1, 0]: the router predicted vLLM's cached_tokens.
    assert b1["0.0"] - b0.get("0.0", 0.0) == observed
    assert b1["-1.0"] - b0.get("-1.0", 0.0) == 0
