"""The consumer already holds part of the prompt: only the rest crosses kvtier P2P, and vLLM is
told only about the blocks the producer adds beyond the consumer's own prefix-cache hit."""

from __future__ import annotations

import pytest

from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE
from tests.vllm.conftest import prompt_ids
from tests.vllm.connector.conftest import (
    PAGE_BYTES,
    Counters,
    KvtierStack,
    complete,
    single_node_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_only_the_missing_blocks_cross(kvtier_stack: KvtierStack) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(120, 5 * VLLM_BLOCK_SIZE + 7)
    # d1 computes the first two blocks itself (a plain request): its prefix cache holds them.
    complete(stack.url("d1"), prompt[: 2 * VLLM_BLOCK_SIZE], max_tokens=1)
    want = single_node_tokens(stack, prompt)

    consumer = Counters(stack.url("d1"))
    answer = complete(stack.pd_url, prompt)
    assert answer["choices"][0]["token_ids"] == want
    got = consumer.delta()
    assert got["kvtier_blocks_fetched"] == got["kvtier_blocks_loaded"] == 3
    assert got["kvtier_fetch_bytes"] == 3 * PAGE_BYTES
    # get_num_new_matched_tokens reported only the producer's blocks past the local hit.
    assert got["external_prefix_cache_hits"] == 3 * VLLM_BLOCK_SIZE
    # vLLM's usage counts local and loaded blocks alike as cached (unlike after a NIXL load).
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 5 * VLLM_BLOCK_SIZE
