"""kvtier's vLLM connector through pdproxy's p2p dialect: PD output equals one vLLM alone, every
full prompt block crosses kvtier P2P, and a warm producer still supplies every block."""

from __future__ import annotations

import httpx
import pytest

from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE
from tests.vllm.conftest import MODEL, prompt_ids
from tests.vllm.connector.conftest import (
    PAGE_BYTES,
    Counters,
    KvtierStack,
    complete,
    settled_gauges,
    single_node_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def _pd(stack: KvtierStack, prompt: list[int]) -> httpx.Response:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = httpx.post(stack.pd_url + "/v1/completions", json=body, timeout=180)
    assert resp.status_code == 200, resp.text
    assert "producer" in resp.headers["server-timing"]  # both legs ran
    assert "x-pdproxy-fallback" not in resp.headers
    return resp


@pytest.mark.parametrize(
    ("seed", "length"),
    [
        (101, 40),  # shorter than a block: no block has a key, the consumer computes it all
        (102, VLLM_BLOCK_SIZE),  # exactly one block
        (103, 2 * VLLM_BLOCK_SIZE + 45),  # unaligned
        (104, 9 * VLLM_BLOCK_SIZE + 77),  # long
    ],
)
def test_pd_equals_single_node(kvtier_stack: KvtierStack, seed: int, length: int) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(seed, length)
    consumer, producer = Counters(stack.url("d1")), Counters(stack.url("p1"))
    pd = _pd(stack, prompt)
    blocks = length // VLLM_BLOCK_SIZE

    assert pd.json()["choices"][0]["token_ids"] == single_node_tokens(stack, prompt)
    got, supplied = consumer.delta(), producer.delta()
    assert supplied["kvtier_blocks_supplied"] == blocks
    assert supplied["kvtier_blocks_stored"] == blocks  # a cold producer copies every block
    assert got["kvtier_blocks_fetched"] == blocks
    assert got["kvtier_fetch_bytes"] == blocks * PAGE_BYTES
    assert got["kvtier_blocks_loaded"] == blocks
    assert got["kvtier_blocks_recomputed"] == got["kvtier_fetch_failures"] == 0
    # vLLM itself counts the loaded tokens as external prefix-cache hits (the single-node
    # reference ran on d1 too, with a fresh salt: no hits there).
    assert got["external_prefix_cache_hits"] == blocks * VLLM_BLOCK_SIZE


def test_warm_producer_supplies_every_block(kvtier_stack: KvtierStack) -> None:
    """vLLM #52808's scenario: the producer already holds the prompt's prefix in its prefix
    cache, so its prefill computes only the tail and ``save_kv_layer`` would never see the hit
    blocks. The consumer must still receive every block: no timeout, no recompute."""
    stack = kvtier_stack
    prompt = prompt_ids(110, 4 * VLLM_BLOCK_SIZE + 10)
    complete(stack.url("p1"), prompt, max_tokens=1)  # warm p1's prefix cache, nothing supplied
    want = single_node_tokens(stack, prompt)

    consumer, producer = Counters(stack.url("d1")), Counters(stack.url("p1"))
    pd = _pd(stack, prompt)
    assert pd.json()["choices"][0]["token_ids"] == want
    got, supplied = consumer.delta(), producer.delta()
    assert supplied["kvtier_blocks_supplied"] == 4
    assert supplied["kvtier_blocks_stored"] == 4  # the hit blocks, copied from vLLM's cache
    assert got["kvtier_blocks_fetched"] == got["kvtier_blocks_loaded"] == 4
    assert got["kvtier_blocks_recomputed"] == got["kvtier_fetch_failures"] == 0
    assert got["external_prefix_cache_hits"] == 4 * VLLM_BLOCK_SIZE

    # The same prompt again: the producer's host tier holds every block (supplied without a
    # copy), and the consumer's prefix cache does too: nothing crosses, the supply is released.
    consumer, producer = Counters(stack.url("d1")), Counters(stack.url("p1"))
    again = _pd(stack, prompt)
    assert again.json()["choices"][0]["token_ids"] == want
    got, supplied = consumer.delta(), producer.delta()
    assert supplied["kvtier_blocks_supplied"] == 4
    assert supplied["kvtier_blocks_stored"] == 0
    assert got["kvtier_blocks_fetched"] == got["kvtier_fetch_bytes"] == 0
    assert got["kvtier_fetch_failures"] == 0

    # Nothing pinned, supplied or in flight on either side once the legs are over.
    assert not any(settled_gauges(stack.url("p1")).values())
    assert not any(settled_gauges(stack.url("d1")).values())
