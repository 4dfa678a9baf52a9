"""The producer dies while the consumer fetches from it: the consumer recomputes what it could
not fetch, answers correctly within its fetch deadline, and leaks nothing.

Runs last in this package (file order): ``p1`` stays dead afterwards."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import uuid
from typing import Any

import pytest

from pdproxy.stack.vllm_engine import VLLM_BLOCK_SIZE
from tests.vllm.conftest import prompt_ids
from tests.vllm.connector.conftest import (
    LEAK_GAUGES,
    Counters,
    KvtierStack,
    complete,
    settled_gauges,
    single_node_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

FETCH_TIMEOUT_S = 10.0
"""The connector's default ``fetch_timeout_s``."""


def test_producer_killed_mid_transfer(kvtier_stack: KvtierStack) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(130, 6 * VLLM_BLOCK_SIZE + 3)
    want = single_node_tokens(stack, prompt)

    # The producer leg, sent by hand (what pdproxy sends), leaves a supply of 6 blocks on p1.
    kv_request_id = uuid.uuid4().hex
    produced = complete(
        stack.url("p1"),
        prompt,
        max_tokens=1,
        kv_transfer_params={"remote_decoder": {"kv_request_id": kv_request_id}},
    )
    answer = produced["kv_transfer_params"]
    assert answer["kv_request_id"] == kv_request_id and answer["num_blocks"] == 6
    consumer_leg: dict[str, Any] = {
        "remote_prefiller": {
            "kv_request_id": kv_request_id,
            "remote_host": answer["remote_host"],
            "remote_port": answer["remote_port"],
            "remote_engine_id": answer["remote_engine_id"],
        }
    }

    # Freeze p1 so the consumer's fetch is under way when p1 dies: its connection is accepted
    # by the kernel and then waits for a producer that never answers.
    producer = stack.child("p1")
    producer.signal_group(signal.SIGSTOP)
    counters = Counters(stack.url("d1"))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        leg = pool.submit(complete, stack.url("d1"), prompt, kv_transfer_params=consumer_leg)
        time.sleep(1.0)
        producer.signal_group(signal.SIGKILL)
        producer.signal_group(signal.SIGCONT)
        result = leg.result(timeout=180)
    assert producer.wait(deadline=float("inf")) is not None

    assert result["choices"][0]["token_ids"] == want
    got = counters.delta()
    assert got["kvtier_fetch_failures"] == 1
    assert got["kvtier_blocks_loaded"] == 0
    assert got["kvtier_blocks_recomputed"] == 6  # from the first missing block: all of them
    # vLLM counts a planned load's tokens as external hits at admission, whatever follows.
    assert got["external_prefix_cache_hits"] == 6 * VLLM_BLOCK_SIZE
    # The fetch ended within its deadline (the client's own clock; a contract, not a speed).
    assert got["kvtier_fetch_seconds"] <= FETCH_TIMEOUT_S + 1.0
    gauges = settled_gauges(stack.url("d1"))
    assert gauges == dict.fromkeys(LEAK_GAUGES, 0.0)
