"""The seed's scenario (warm vs cold producer), release, and legs that must fall back to local."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import free_port

from .pd_helpers import assert_released, connector, pd_request, workers

PROMPT = "A long shared system prompt about KV caches and where they live. " * 6  # 390 tokens


@pytest.mark.parametrize("model", ["tiny", "sim"])
async def test_warm_producer_supplies_the_same_bytes_as_cold(model: str) -> None:
    """vLLM #52808: a producer whose prefix cache already holds the prompt must still supply it.

    cold: nothing cached anywhere. host-warm: the producer's host tier holds every block from
    the cold run (they cascade, nothing is copied GPU→host). gpu-warm: a second producer served
    the prompt plainly first, so its GPU holds the blocks and its host tier does not.
    """
    roles = ("producer", "producer", "consumer", "consumer", "consumer", "both")
    async with workers(model, *roles) as (p1, p2, c_cold, c_host, c_gpu, single):
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        expected = (await single.client.post("/v1/completions", json=body)).json()
        expected_ids = expected["choices"][0]["token_ids"]

        cold = await pd_request(p1, c_cold, body, "p2p")
        host_pages_after_cold = connector(p1).pool.stats().readable
        host_warm = await pd_request(p1, c_host, body, "p2p")
        assert connector(p1).pool.stats().readable == host_pages_after_cold  # nothing new copied
        assert connector(p1).manager.stats().cascaded > 0

        plain = await p2.client.post("/v1/completions", json=body)
        assert plain.status_code == 200
        gpu_warm = await pd_request(p2, c_gpu, body, "p2p")
        assert gpu_warm.producer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        fetched = []
        for run, consumer in ((cold, c_cold), (host_warm, c_host), (gpu_warm, c_gpu)):
            assert run.token_ids == expected_ids
            stats = consumer.worker.stats
            assert stats.p2p_fetch_failures == 0  # no timeout, no refusal
            assert stats.recomputed_tokens == 0
            assert stats.p2p_bytes_fetched > 0
            fetched.append(stats.p2p_bytes_fetched)
        assert fetched[0] == fetched[1] == fetched[2]
        assert_released(p1, p2, c_cold, c_host, c_gpu)


async def test_release_endpoint_drops_an_unclaimed_supply() -> None:
    async with workers("sim", "producer") as (producer,):
        leg = {
            "prompt": PROMPT,
            "max_tokens": 1,
            "kv_transfer_params": {"remote_decoder": {"kv_request_id": "orphan"}},
        }
        answer = (await producer.client.post("/v1/completions", json=leg)).json()
        assert answer["kv_transfer_params"]["num_blocks"] == len(PROMPT) // 16
        registry = connector(producer).registry
        assert registry.is_open("orphan") and registry.stats().held_pages > 0  # type: ignore[arg-type]
        resp = await producer.client.post("/v1/kv/release", json={"kv_request_id": "orphan"})
        assert resp.json() == {"kv_request_id": "orphan", "released": True}
        again = await producer.client.post("/v1/kv/release", json={"kv_request_id": "orphan"})
        assert again.json()["released"] is False
        bad = await producer.client.post("/v1/kv/release", json={})
        assert bad.status_code == 400
        assert_released(producer)


async def test_consumer_of_a_released_supply_recomputes_at_once() -> None:
    async with workers("sim", "producer", "consumer", "both") as (producer, consumer, single):
        body: dict[str, Any] = {
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "return_token_ids": True,
        }
        expected = (await single.client.post("/v1/completions", json=body)).json()
        leg = {
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {"remote_decoder": {"kv_request_id": "gone"}},
        }
        answer = (await producer.client.post("/v1/completions", json=leg)).json()
        await producer.client.post("/v1/kv/release", json={"kv_request_id": "gone"})
        params = answer["kv_transfer_params"]
        consumer_body = {
            **body,
            "kv_transfer_params": {
                "remote_prefiller": {
                    "kv_request_id": "gone",
                    "remote_host": params["remote_host"],
                    "remote_port": params["remote_port"],
                }
            },
        }
        got = (await consumer.client.post("/v1/completions", json=consumer_body)).json()
        assert got["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        stats = consumer.worker.stats
        assert stats.p2p_fetch_failures == 1
        assert stats.recomputed_tokens == (len(PROMPT) - 1) // 16 * 16
        assert_released(producer, consumer)


@pytest.mark.parametrize(
    "params",
    [
        {
            "remote_prefiller": {
                "kv_request_id": "k",
                "remote_host": "127.0.0.1",
                "remote_port": "free",
            }
        },
        {
            "do_remote_prefill": True,
            "remote_request_id": "k",
            "remote_host": "127.0.0.1",
            "remote_port": "free",
            "remote_block_ids": [1, 2],
            "remote_engine_id": "x",
            "tp_size": 1,
        },
    ],
)
async def test_unreachable_producer_means_local_compute(params: dict[str, Any]) -> None:
    async with workers("tiny", "consumer", "both") as (consumer, single):
        port = free_port()
        for value in params.values():
            if isinstance(value, dict) and value.get("remote_port") == "free":
                value["remote_port"] = port
        if params.get("remote_port") == "free":
            params["remote_port"] = port
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        expected = (await single.client.post("/v1/completions", json=body)).json()
        resp = await consumer.client.post(
            "/v1/completions", json={**body, "kv_transfer_params": params}
        )
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]
        stats = consumer.worker.stats
        assert stats.p2p_fetch_failures == 1 and stats.recomputed_tokens > 0


@pytest.mark.parametrize(
    "params",
    [
        {"remote_decoder": {}},
        {"remote_decoder": {"kv_request_id": ""}},
        {"remote_decoder": "k"},
        {"remote_prefiller": {"kv_request_id": "k"}},
        {"remote_prefiller": {"kv_request_id": "k", "remote_host": "h", "remote_port": 70000}},
        {"do_remote_prefill": True, "remote_request_id": "k"},
        {"something_else": 1},
    ],
)
async def test_malformed_kv_transfer_params_run_locally_and_are_counted(
    params: dict[str, Any],
) -> None:
    async with workers("sim", "both") as (worker,):
        body = {"prompt": "hello there", "max_tokens": 3, "temperature": 0}
        plain = (await worker.client.post("/v1/completions", json=body)).json()
        resp = await worker.client.post(
            "/v1/completions", json={**body, "kv_transfer_params": params}
        )
        assert resp.status_code == 200
        data = resp.json()
        assert data["choices"][0]["text"] == plain["choices"][0]["text"]
        assert data["kv_transfer_params"] is None
        assert worker.worker.stats.kv_params_fallbacks == 1
        assert_released(worker)


async def test_partial_supply_recomputes_from_the_first_gap() -> None:
    """A producer whose host tier can take only 6 pages supplies blocks 0-5 and fails the rest
    explicitly (POOL_EXHAUSTED): the consumer installs 0-5 and recomputes from block 6."""
    async with (
        workers("tiny", "producer", tiny_layers=1, host_pages=6) as (producer,),
        workers("tiny", "consumer", "both", tiny_layers=1) as (consumer, single),
    ):
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
        expected = (await single.client.post("/v1/completions", json=body)).json()
        result = await pd_request(producer, consumer, body, "p2p")
        assert result.token_ids == expected["choices"][0]["token_ids"]
        assert result.consumer["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 16
        stats = consumer.worker.stats
        cap = (len(PROMPT) - 1) // 16
        assert stats.p2p_blocks_fetched == 6 and stats.p2p_fetch_failures == 1
        assert stats.recomputed_tokens == (cap - 6) * 16
        assert connector(producer).manager.stats().refused > 0
        assert_released(producer, consumer)
