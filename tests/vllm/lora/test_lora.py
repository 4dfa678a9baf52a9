"""A LoRA adapter on real vLLM behind pdproxy: routed only to the engines that loaded it, its KV
blocks never taken for the base model's (in vLLM's events, its prefix cache and the router's
index), and its answers through PD equal to one vLLM's with the adapter."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.events import BlockStored, EventBatch, EventSubscriber
from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE
from tests.vllm.conftest import prompt_ids, route_of, vllm_metric
from tests.vllm.lora.conftest import ADAPTER, MODEL, LoraStack, complete, token_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

EVENTS_WITHIN_S = 20.0


def test_adapter_requests_reach_only_the_engines_that_loaded_it(lora_stack: LoraStack) -> None:
    finished_on_d1 = vllm_metric(lora_stack.url("d1"), "vllm:request_success_total")
    for seed in range(4):
        resp = complete(lora_stack.pd_url, ADAPTER, prompt_ids(100 + seed, 200), max_tokens=4)
        route = route_of(resp)
        assert [c["name"] for c in route["consumers"]] == ["d0"], route  # type: ignore[union-attr]
        assert [p["name"] for p in route["producers"]] == ["p0"], route  # type: ignore[union-attr]
        assert resp.json()["model"] == ADAPTER
    assert vllm_metric(lora_stack.url("d1"), "vllm:request_success_total") == finished_on_d1
    # The base model is served by both consumers: d1 is a real candidate, not a dead one.
    base = complete(lora_stack.url("d1"), MODEL, prompt_ids(110, 40), max_tokens=2)
    assert base.json()["model"] == MODEL


def test_adapter_answers_through_pd_equal_one_vllm_with_the_adapter(lora_stack: LoraStack) -> None:
    for seed in range(3):
        prompt = prompt_ids(200 + seed, 2 * VLLM_BLOCK_SIZE + 37)
        pd = complete(lora_stack.pd_url, ADAPTER, prompt)
        assert pd.headers.get("x-pdproxy-fallback") is None  # the KV came over NIXL
        salt = f"reference-{seed}-{time.monotonic_ns()}"  # d0 computes it all itself
        alone = complete(lora_stack.url("d0"), ADAPTER, prompt, cache_salt=salt)
        base = complete(lora_stack.url("d0"), MODEL, prompt, cache_salt=salt + "-base")
        assert token_ids(pd) == token_ids(alone)
        assert token_ids(alone) != token_ids(base)  # the adapter is applied, not ignored


async def test_adapter_blocks_never_match_the_base_models(lora_stack: LoraStack) -> None:
    """The same prompt under the base model, then the adapter, on one engine: vLLM's events
    name the adapter and carry other block hashes, vLLM's prefix cache gives the adapter
    nothing of the base model's blocks, and the router predicts nothing cached for it."""
    d0 = lora_stack.instances["d0"]
    prompt = prompt_ids(300, 3 * VLLM_BLOCK_SIZE + 5)
    batches: list[EventBatch] = []

    async def on_batch(batch: EventBatch) -> None:
        batches.append(batch)

    def stored(lora: bool) -> list[BlockStored]:
        return [
            e
            for b in batches
            for e in b.events
            if isinstance(e, BlockStored)
            and list(e.token_ids) == prompt[: len(e.token_ids)]
            and (e.lora_name is not None or e.lora_id is not None) == lora
        ]

    subscriber = EventSubscriber(
        d0.events_endpoint, d0.replay_endpoint, on_batch=on_batch, replay_timeout_s=EVENTS_WITHIN_S
    )
    async with subscriber:
        await asyncio.sleep(1.0)  # subscribed before vLLM publishes
        await asyncio.to_thread(complete, d0.url, MODEL, prompt, max_tokens=2)
        adapter = await asyncio.to_thread(complete, d0.url, ADAPTER, prompt, max_tokens=2)
        deadline = time.monotonic() + EVENTS_WITHIN_S
        while time.monotonic() < deadline and not (stored(False) and stored(True)):
            await asyncio.sleep(0.2)
    base_events, adapter_events = stored(False), stored(True)
    assert base_events and adapter_events, f"{len(batches)} batches"
    assert {e.lora_name for e in adapter_events} <= {ADAPTER, None}
    base_hashes = {h for e in base_events for h in e.block_hashes}
    adapter_hashes = {h for e in adapter_events for h in e.block_hashes}
    assert len(base_hashes) == len(adapter_hashes) == 3
    assert not base_hashes & adapter_hashes
    # vLLM computed the adapter's prompt itself, though the base model's blocks were cached.
    assert adapter.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # The router follows d0's events (the base model's blocks of ``prompt`` are predicted
    # cached there), but blocks computed only under the adapter count for nobody: the base
    # model's router does not take them, and the adapter's follows no events.
    async def routed(model: str, ids: list[int]) -> dict[str, object]:
        resp = await asyncio.to_thread(complete, lora_stack.pd_url, model, ids, max_tokens=2)
        return route_of(resp)

    def matched_on_d0(route: dict[str, object]) -> int:
        rows: list[dict[str, object]] = route["consumers"]  # type: ignore[assignment]
        return sum(int(r.get("gpu", 0)) for r in rows if r["name"] == "d0")  # type: ignore[call-overload]

    deadline = time.monotonic() + EVENTS_WITHIN_S
    while not matched_on_d0(base_route := await routed(MODEL, prompt)):
        assert time.monotonic() < deadline, base_route
        await asyncio.sleep(0.5)
    only_adapter = prompt_ids(301, 3 * VLLM_BLOCK_SIZE + 5)
    await asyncio.to_thread(complete, d0.url, ADAPTER, only_adapter, max_tokens=2)
    await asyncio.sleep(2.0)  # its events reach the proxy (the base ones above took less)
    assert matched_on_d0(await routed(MODEL, only_adapter)) == 0
    assert matched_on_d0(await routed(ADAPTER, only_adapter)) == 0
