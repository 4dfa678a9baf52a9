"""Symmetric pull (``remote_kv_source``) between two reference workers, in process over real
P2P sockets: the output equals single-node output, the pulled bytes are exactly the holder's
blocks, nothing pulled is recomputed, and a holder that dies mid-pull costs a recompute, never
a wrong answer or a leak."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvtier.worker.kv_layout import needed_blocks
from tests.conftest import free_port
from tests.reliability.faults import TcpRelay

from .pd_helpers import assert_released, connector, workers

PROMPT = "A holder warmed this prefix; a free node pulls it instead of recomputing. " * 6
BS = 16


def source(holder: Any, *, port: int | None = None, node_id: str | None = None) -> dict[str, Any]:
    conn = connector(holder)
    return {
        "remote_host": "127.0.0.1",
        "remote_port": port or conn.p2p_port,
        "remote_engine_id": node_id or conn.engine_id,
    }


async def complete(w: Any, body: dict[str, Any]) -> dict[str, Any]:
    resp = await w.client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


async def metric(w: Any, name: str) -> float:
    text = (await w.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def pulled_bytes(w: Any, prompt_tokens: int) -> int:
    """Bytes of every block a hit of the prompt's usable prefix reads, over all groups."""
    cap = (prompt_tokens - 1) // BS
    return sum(
        len(needed_blocks(cap, pool.spec.sliding_window, BS)) * pool.spec.page_nbytes
        for pool in w.worker.engine.kv.pools
    )


async def settled(*ws: Any) -> None:
    """The holder frees an offer's supply when the puller's ``done`` arrives (asynchronously)."""
    deadline = time.monotonic() + 5
    while any(connector(w).registry.stats().requests for w in ws):
        assert time.monotonic() < deadline, "supplies still held"
        await asyncio.sleep(0.01)
    assert_released(*ws)


@pytest.mark.parametrize("model", ["sim", "tiny"])
async def test_pull_from_a_warm_holder_equals_single_node(model: str) -> None:
    await check_pull_equivalence(model)


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["sim", "tiny"])
async def test_pull_equals_single_node_on_cuda(model: str) -> None:
    """The holder's device→host cascade and the puller's host→device install on CUDA."""
    await check_pull_equivalence(model, device="cuda")


async def check_pull_equivalence(model: str, **overrides: Any) -> None:
    # Both are consumer-role workers: a consumer holds what it decoded and serves offers.
    async with workers(model, "consumer", "consumer", **overrides) as (holder, puller):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        single = await complete(holder, body)  # warms the holder; the single-node answer
        pulled = await complete(puller, {**body, "kv_transfer_params": {
            "remote_kv_source": source(holder)}})  # fmt: skip
        assert pulled["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        n = len(PROMPT.encode())
        # Every block the prompt can reuse came from the holder: none was recomputed.
        assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BS * BS
        assert await metric(puller, "kvtier_worker_pull_bytes_total") == pulled_bytes(puller, n)
        assert await metric(puller, "kvtier_worker_pull_requests_total") == 1
        assert await metric(puller, "kvtier_worker_pull_failures_total") == 0
        assert await metric(puller, "kvtier_worker_pull_short_total") == 0
        # Bytes moved, so their wall time counts (the router divides one by the other).
        assert await metric(puller, "kvtier_worker_pull_seconds_total") > 0
        assert await metric(holder, "kvtier_worker_p2p_offers_total") == 1
        assert puller.worker.stats.recomputed_tokens == 0
        # A second identical request: the puller's own cache has it all; no offer is sent.
        again = await complete(puller, {**body, "kv_transfer_params": {
            "remote_kv_source": source(holder)}})  # fmt: skip
        assert again["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        assert await metric(puller, "kvtier_worker_pull_requests_total") == 1
        await settled(holder, puller)


async def test_pull_cascades_device_only_blocks_of_the_holder() -> None:
    """The holder's host pool is empty (a plain request stores nothing there): the offer
    copies its device blocks into host pages first."""
    async with workers("sim", "consumer", "consumer") as (holder, puller):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        single = await complete(holder, body)
        assert connector(holder).pool.stats().readable == 0
        pulled = await complete(puller, {**body, "kv_transfer_params": {
            "remote_kv_source": source(holder)}})  # fmt: skip
        assert pulled["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        assert connector(holder).pool.stats().readable > 0
        await settled(holder, puller)


async def test_holder_with_part_of_the_prefix() -> None:
    async with workers("sim", "consumer", "consumer") as (holder, puller):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        half = PROMPT[: len(PROMPT) // 2]
        await complete(holder, {**body, "prompt": half})
        pulled = await complete(puller, {**body, "kv_transfer_params": {
            "remote_kv_source": source(holder)}})  # fmt: skip
        single = await complete(holder, body)  # a single node's answer (computed after)
        assert pulled["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        cached = pulled["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached <= len(half.encode())
        # The holder lacking the tail is the normal case: short, not a failure.
        assert await metric(puller, "kvtier_worker_pull_failures_total") == 0
        assert await metric(puller, "kvtier_worker_pull_short_total") == 1
        assert await metric(puller, "kvtier_worker_pull_seconds_total") > 0
        await settled(holder, puller)


async def test_producer_leg_pulls_then_supplies_everything() -> None:
    """``remote_decoder`` + ``remote_kv_source``: the producer pulls the prefix, computes the
    rest, and its consumer still receives every block."""
    async with workers("tiny", "consumer", "producer", "consumer") as (holder, producer, decoder):
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        single = await complete(holder, body)
        leg = {**body, "max_tokens": 1, "kv_transfer_params": {
            "remote_decoder": {"kv_request_id": "k" * 32},
            "remote_kv_source": source(holder)}}  # fmt: skip
        answer = (await complete(producer, leg))["kv_transfer_params"]
        assert await metric(producer, "kvtier_worker_pull_blocks_total") > 0
        consumer_leg = {**body, "kv_transfer_params": {"remote_prefiller": {
            "kv_request_id": answer["kv_request_id"], "remote_host": answer["remote_host"],
            "remote_port": answer["remote_port"],
            "remote_engine_id": answer["remote_engine_id"]}}}  # fmt: skip
        decoded = await complete(decoder, consumer_leg)
        assert decoded["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        assert decoder.worker.stats.recomputed_tokens == 0
        await settled(holder, producer, decoder)


async def test_wrong_holder_node_id_recomputes() -> None:
    async with workers("sim", "consumer", "consumer") as (holder, puller):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        single = await complete(holder, body)
        pulled = await complete(puller, {**body, "kv_transfer_params": {
            "remote_kv_source": source(holder, node_id="not-the-holder")}})  # fmt: skip
        assert pulled["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert await metric(puller, "kvtier_worker_pull_failures_total") == 1
        await settled(holder, puller)


async def test_holder_outside_the_allowlist_is_refused() -> None:
    async with workers("sim", "consumer") as (puller,):
        resp = await puller.client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": {"remote_kv_source": {
                "remote_host": "10.1.2.3", "remote_port": 5600}}})  # fmt: skip
        assert resp.status_code == 400 and "remote_kv_source" in resp.text


async def test_holder_dies_mid_pull() -> None:
    """The pull's connection dies after part of the transfer: the blocks that arrived are
    used, the rest recomputed, the answer exact, within the fetch deadline, and neither side
    keeps a supply or a pinned page."""
    async with workers("tiny", "consumer", "consumer") as (holder, puller):
        body = {"prompt": PROMPT * 2, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        single = await complete(holder, body)
        async with TcpRelay(connector(holder).p2p_port) as relay:
            cut: list[int] = []

            def cut_once(total: int) -> None:
                if total >= 64 * 1024 and not cut:  # a few 16 KiB pages, long before the end
                    cut.append(total)
                    relay.cut()

            relay.on_upstream_bytes = cut_once
            started = time.monotonic()
            pulled = await complete(puller, {**body, "kv_transfer_params": {
                "remote_kv_source": source(holder, port=relay.port)}})  # fmt: skip
            elapsed = time.monotonic() - started
        assert cut, "the pull finished before the connection could be cut"
        assert pulled["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]
        assert await metric(puller, "kvtier_worker_pull_failures_total") == 1
        assert await metric(puller, "kvtier_worker_pull_blocks_total") > 0
        assert elapsed < puller.worker.settings.fetch_timeout_s + 30  # bounded, not timed
        await settled(holder, puller)
        assert await metric(holder, "kvtier_worker_p2p_supplies") == 0
        assert await metric(puller, "kvtier_worker_p2p_supplies") == 0


async def test_unreachable_holder_recomputes_within_the_deadline() -> None:
    async with workers("sim", "consumer", fetch_timeout_s=2.0) as (puller,):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
        pulled = await complete(puller, {**body, "kv_transfer_params": {"remote_kv_source": {
            "remote_host": "127.0.0.1", "remote_port": free_port()}}})  # fmt: skip
        assert pulled["choices"][0]["finish_reason"] == "length"
        assert await metric(puller, "kvtier_worker_pull_failures_total") == 1
        assert await metric(puller, "kvtier_worker_pull_short_total") == 0
        # No bytes moved: no seconds either (they would drag the router's link speed down).
        assert await metric(puller, "kvtier_worker_pull_seconds_total") == 0
        assert_released(puller)


async def test_every_role_is_a_holder_unless_told_not_to_be() -> None:
    async with workers("sim", "consumer", "producer") as (consumer, producer):
        for w in (consumer, producer):
            conn = connector(w)
            assert conn.server is not None and conn.server.offers is not None
            assert conn.p2p_port > 0
    async with workers("sim", "consumer", p2p_holder=False) as (plain,):
        assert connector(plain).server is None and connector(plain).p2p_port == 0
    async with workers("sim", "producer", p2p_holder=False) as (producer,):
        server = connector(producer).server
        assert server is not None and server.offers is None  # supplies, answers no offers
