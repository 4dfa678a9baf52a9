"""``remote_kv_source`` between two real vLLM instances: the consumer asks a holder which of the
prompt's blocks it holds in its kvtier host pages, pulls the ones it lacks past its own prefix
hit, and computes the rest; a holder that is gone or frozen costs a recompute, never an answer.

``p1`` is the holder: a producer leg (what pdproxy's PD request sends) puts the prompt's blocks
in its host pages. ``d1`` pulls. The other way round, ``d1`` (``offload_prompts``) holds what it
computed alone, and ``p1`` pulls it. Both run before ``test_connector_producer_killed.py`` (file
order), which leaves ``p1`` dead."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from typing import Any

import pytest

from kvtier.p2p import LayoutFingerprint, LocalIdentity, P2PClient, P2PSettings
from kvtier.p2p.frames import PeerNodeId
from kvtier.vllm.offers import NoPages
from pdproxy.stack.vllm_engine import SERVED_NAME, VLLM_BLOCK_SIZE
from tests.conftest import free_port
from tests.vllm.conftest import prompt_ids, vllm_metric
from tests.vllm.connector.conftest import (
    LEAK_GAUGES,
    PAGE_BYTES,
    Counters,
    KvtierStack,
    complete,
    settled_gauges,
    single_node_tokens,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

HOLDER_COUNTERS = ("vllm:kvtier_offers_answered_total", "vllm:kvtier_blocks_offered_total")
OFFLOAD_COUNTERS = ("vllm:kvtier_blocks_offloaded_total", "vllm:kvtier_offload_seconds_total")


def _warm_holder(stack: KvtierStack, prompt: list[int]) -> dict[str, Any]:
    """A producer leg on ``p1`` (as pdproxy sends it): the prompt's blocks land in p1's host
    pages under a supply K; returns p1's answer."""
    answer: dict[str, Any] = complete(
        stack.url("p1"),
        prompt,
        max_tokens=1,
        kv_transfer_params={"remote_decoder": {"kv_request_id": uuid.uuid4().hex}},
    )["kv_transfer_params"]
    return answer


def _release(stack: KvtierStack, answer: dict[str, Any]) -> None:
    """Release the producer leg's supply K (the proxy does this when no consumer leg follows);
    the pages stay in p1's host pool, so later offers still find them."""

    async def run() -> bool:
        fingerprint = LayoutFingerprint(
            f"vllm/{SERVED_NAME}", VLLM_BLOCK_SIZE, "torch.bfloat16", (PAGE_BYTES,)
        )
        identity = LocalIdentity(PeerNodeId("test"), fingerprint, stack.p2p_secret.encode())
        client = P2PClient(P2PSettings(), identity, NoPages())
        try:
            return await client.release(
                answer["remote_host"],
                answer["remote_port"],
                answer["kv_request_id"],
                expected_node_id=answer["remote_engine_id"],
            )
        finally:
            await client.close()

    assert asyncio.run(run())


def _source(answer: dict[str, Any]) -> dict[str, Any]:
    return {
        "remote_kv_source": {
            "remote_host": answer["remote_host"],
            "remote_port": answer["remote_port"],
            "remote_engine_id": answer["remote_engine_id"],
        }
    }


def test_pull_every_block_the_holder_has(kvtier_stack: KvtierStack) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(150, 4 * VLLM_BLOCK_SIZE + 9)
    want = single_node_tokens(stack, prompt)
    answer = _warm_holder(stack, prompt)
    _release(stack, answer)

    holder, puller = Counters(stack.url("p1")), Counters(stack.url("d1"))
    holder_offers = {n: vllm_metric(stack.url("p1"), n) for n in HOLDER_COUNTERS}
    pulled = complete(stack.url("d1"), prompt, kv_transfer_params=_source(answer))

    assert pulled["choices"][0]["token_ids"] == want
    got = puller.delta()
    assert got["kvtier_blocks_fetched"] == got["kvtier_blocks_loaded"] == 4
    assert got["kvtier_fetch_bytes"] == 4 * PAGE_BYTES
    assert got["kvtier_blocks_recomputed"] == got["kvtier_fetch_failures"] == 0
    assert got["external_prefix_cache_hits"] == 4 * VLLM_BLOCK_SIZE
    # The holder copied nothing for the pull: it served the host pages its producer leg left.
    assert holder.delta()["kvtier_blocks_stored"] == 0
    # The offer's supply K2 ended with the puller's done: nothing pinned on either side.
    assert settled_gauges(stack.url("p1")) == dict.fromkeys(LEAK_GAUGES, 0.0)
    # (read after p1 stepped: an idle engine reports its connector's stats at its next step)
    offers = {n: vllm_metric(stack.url("p1"), n) - v for n, v in holder_offers.items()}
    assert offers == {HOLDER_COUNTERS[0]: 1, HOLDER_COUNTERS[1]: 4}
    assert settled_gauges(stack.url("d1")) == dict.fromkeys(LEAK_GAUGES, 0.0)


def test_pull_only_past_the_local_hit_and_up_to_the_held_run(kvtier_stack: KvtierStack) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(151, 6 * VLLM_BLOCK_SIZE + 3)
    want = single_node_tokens(stack, prompt)
    # The holder has the first 4 blocks; the puller computed the first 1 itself.
    answer = _warm_holder(stack, prompt[: 4 * VLLM_BLOCK_SIZE + 5])
    _release(stack, answer)
    complete(stack.url("d1"), prompt[: VLLM_BLOCK_SIZE + 2], max_tokens=1)

    puller = Counters(stack.url("d1"))
    pulled = complete(stack.url("d1"), prompt, kv_transfer_params=_source(answer))

    assert pulled["choices"][0]["token_ids"] == want
    got = puller.delta()
    assert got["kvtier_blocks_fetched"] == got["kvtier_blocks_loaded"] == 3
    assert got["kvtier_fetch_bytes"] == 3 * PAGE_BYTES
    assert got["external_prefix_cache_hits"] == 3 * VLLM_BLOCK_SIZE
    assert settled_gauges(stack.url("p1")) == dict.fromkeys(LEAK_GAUGES, 0.0)


def test_holder_gone_or_frozen_recomputes(kvtier_stack: KvtierStack) -> None:
    stack = kvtier_stack
    prompt = prompt_ids(152, 3 * VLLM_BLOCK_SIZE + 1)
    want = single_node_tokens(stack, prompt)
    answer = _warm_holder(stack, prompt)
    _release(stack, answer)

    # Nothing listens where the source points: the offer is refused at once.
    gone = {**answer, "remote_port": free_port()}
    puller = Counters(stack.url("d1"))
    pulled = complete(stack.url("d1"), prompt, kv_transfer_params=_source(gone))
    assert pulled["choices"][0]["token_ids"] == want
    got = puller.delta()
    assert got["external_prefix_cache_hits"] == got["kvtier_blocks_fetched"] == 0

    # A holder outside kv_source_allowed_peers (default: loopback) is never contacted: a client
    # cannot aim the engine at an address of its choosing. "127.1" reaches p1 (the resolver
    # reads it as 127.0.0.1), but the allowlist compares it as a host name, which nothing
    # allows: without the check, this would pull p1's blocks.
    disguised = {**answer, "remote_host": "127.1"}
    fresh = prompt_ids(155, 2 * VLLM_BLOCK_SIZE + 1)
    want_fresh = single_node_tokens(stack, fresh)
    warm_fresh = _warm_holder(stack, fresh)
    _release(stack, warm_fresh)
    puller = Counters(stack.url("d1"))
    pulled = complete(stack.url("d1"), fresh, kv_transfer_params=_source(disguised))
    assert pulled["choices"][0]["token_ids"] == want_fresh
    got = puller.delta()
    assert got["external_prefix_cache_hits"] == got["kvtier_blocks_fetched"] == 0

    # The holder is frozen: the kernel accepts the connection, nobody answers. The request waits
    # for the offer's deadline (offer_timeout_s), then computes the prompt itself.
    holder = stack.child("p1")
    salted = prompt_ids(153, 3 * VLLM_BLOCK_SIZE + 1)
    want_salted = single_node_tokens(stack, salted)
    warm = _warm_holder(stack, salted)
    _release(stack, warm)
    puller = Counters(stack.url("d1"))
    holder.signal_group(signal.SIGSTOP)
    try:
        started = time.monotonic()
        pulled = complete(stack.url("d1"), salted, kv_transfer_params=_source(warm))
        waited = time.monotonic() - started
    finally:
        holder.signal_group(signal.SIGCONT)
    assert pulled["choices"][0]["token_ids"] == want_salted
    got = puller.delta()
    assert got["external_prefix_cache_hits"] == got["kvtier_blocks_fetched"] == 0
    print(f"\nfrozen holder: the pull's request answered after {waited:.1f} s")
    assert settled_gauges(stack.url("p1")) == dict.fromkeys(LEAK_GAUGES, 0.0)
    assert settled_gauges(stack.url("d1")) == dict.fromkeys(LEAK_GAUGES, 0.0)


def test_pull_what_the_holder_computed_alone(kvtier_stack: KvtierStack) -> None:
    """d1 runs with ``offload_prompts``: a plain request's prompt blocks land in its host pages
    in the step that completes the prompt, so p1 can pull them without any producer leg."""
    stack = kvtier_stack
    prompt = prompt_ids(154, 5 * VLLM_BLOCK_SIZE + 11)
    want = single_node_tokens(stack, prompt)
    holder = Counters(stack.url("d1"))
    offloaded_before = {n: vllm_metric(stack.url("d1"), n) for n in OFFLOAD_COUNTERS}
    assert complete(stack.url("d1"), prompt, max_tokens=1)["choices"][0]["token_ids"] == want[:1]
    source = {
        "remote_kv_source": {
            "remote_host": "127.0.0.1",
            "remote_port": stack.instances["d1"].p2p_port,
        }
    }

    puller = Counters(stack.url("p1"))
    pulled = complete(stack.url("p1"), prompt, kv_transfer_params=source)

    assert pulled["choices"][0]["token_ids"] == want
    got = puller.delta()
    assert got["kvtier_blocks_fetched"] == got["kvtier_blocks_loaded"] == 5
    assert got["kvtier_fetch_bytes"] == 5 * PAGE_BYTES
    assert got["external_prefix_cache_hits"] == 5 * VLLM_BLOCK_SIZE
    assert holder.delta()["kvtier_blocks_stored"] == 0  # no supply: an offload, not a leg
    assert settled_gauges(stack.url("d1")) == dict.fromkeys(LEAK_GAUGES, 0.0)
    offloaded = {n: vllm_metric(stack.url("d1"), n) - v for n, v in offloaded_before.items()}
    # The plain request's 5 blocks, plus the settling requests' none (shorter than a block).
    assert offloaded[OFFLOAD_COUNTERS[0]] == 5
    per_block_ms = offloaded[OFFLOAD_COUNTERS[1]] / 5 * 1e3
    print(f"\noffload_prompts: {per_block_ms:.3f} ms of engine thread per {PAGE_BYTES} B block")
