"""LoRA adapters of the reference worker: served as model names (vLLM's way), each with its own
deterministic output, its own block hashes (a base prefix is never a hit for an adapter), PD
output equal to single node under an adapter, loading and unloading at run time, and KV events
that name the adapter."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.events import BlockStored
from kvtier.keys import BlockHasher

from .conftest import running_worker, small_settings
from .pd_helpers import pd_request, workers

PROMPT = "The adapter sees this prompt: " * 3  # 90 tokens: 5 full blocks and a tail


def body(model: str, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "return_token_ids": True, **extra,
    }  # fmt: skip


async def complete(client: Any, payload: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


@pytest.mark.parametrize("model", ["sim", "tiny"])
async def test_each_adapter_has_its_own_deterministic_output(model: str) -> None:
    settings = small_settings(model=model, lora_modules=["style-a", "style-b=/adapters/b"])
    async with running_worker(settings) as w:
        base_name = settings.model_name
        models = (await w.client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            (base_name, None), ("style-a", base_name), ("style-b", base_name),
        ]  # fmt: skip
        assert models[2]["root"] == "/adapters/b"
        texts = {}
        for name in (base_name, "style-a", "style-b"):
            first = await complete(w.client, body(name))
            again = await complete(w.client, body(name))
            assert first["model"] == name
            assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
            texts[name] = tuple(first["choices"][0]["token_ids"])
        assert len(set(texts.values())) == 3, texts
        short = {n: (await complete(w.client, body(n, "Hi")))["choices"][0]["text"] for n in texts}
        assert len(set(short.values())) == 3, short  # shorter than a block: still its own text


async def test_a_base_prefix_is_never_a_hit_for_an_adapter() -> None:
    async with running_worker(small_settings(model="sim", lora_modules=["a"])) as w:
        base = w.worker.settings.model_name
        await complete(w.client, body(base))
        usage = (await complete(w.client, body("a")))["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        usage = (await complete(w.client, body("a")))["usage"]  # its own blocks now
        assert usage["prompt_tokens_details"]["cached_tokens"] == 80
        hasher = BlockHasher("x", 16)
        ids = list(PROMPT.encode())
        assert not set(hasher.hash_tokens(ids)) & set(hasher.hash_tokens(ids, lora_name="a"))


async def test_adapters_load_and_unload_at_run_time() -> None:
    async with running_worker(small_settings(model="sim", max_loras=1)) as w:
        assert (await w.client.post("/v1/completions", json=body("late"))).status_code == 404
        resp = await w.client.post(
            "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/x"}
        )
        assert resp.status_code == 200, resp.text
        assert [m["id"] for m in (await w.client.get("/v1/models")).json()["data"]][1:] == ["late"]
        await complete(w.client, body("late"))
        again = await w.client.post("/v1/load_lora_adapter", json={"lora_name": "late"})
        assert again.status_code == 400
        full = await w.client.post("/v1/load_lora_adapter", json={"lora_name": "second"})
        assert full.status_code == 400 and "at most 1" in full.json()["error"]["message"]
        bad = await w.client.post("/v1/load_lora_adapter", json={"lora_name": "bad\nname"})
        assert bad.status_code == 400
        resp = await w.client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert resp.status_code == 200
        assert (await w.client.post("/v1/completions", json=body("late"))).status_code == 404


async def test_adapter_blocks_are_published_with_the_adapter() -> None:
    async with running_worker(small_settings(model="sim", lora_modules=["a"])) as w:
        base = w.worker.settings.model_name
        await complete(w.client, body(base))
        await complete(w.client, body("a"))
        batch = w.worker.events.take_batch()
        assert batch is not None
        stored = [e for e in batch.events if isinstance(e, BlockStored) and e.medium == "GPU"]
        by_adapter = {(e.lora_id, e.lora_name) for e in stored}
        assert by_adapter == {(None, None), (1, "a")}
        adapter_tokens = b"".join(bytes(e.token_ids) for e in stored if e.lora_name == "a")
        assert adapter_tokens.startswith(PROMPT.encode()[:80])


@pytest.mark.parametrize("model", ["sim", "tiny"])
async def test_pd_under_an_adapter_equals_single_node(model: str) -> None:
    async with workers(model, "producer", "consumer", "both", lora_modules=["a"]) as (
        producer,
        consumer,
        single,
    ):
        payload = body("a")
        expected = (await complete(single.client, payload))["choices"][0]["token_ids"]
        result = await pd_request(producer, consumer, payload, "p2p")
        assert result.token_ids == expected
        assert consumer.worker.stats.recomputed_tokens == 0


async def test_loading_adapters_needs_the_key() -> None:
    """An attacker reaching the worker without the proxy's key can neither load nor unload."""
    key = "k" * 32
    async with running_worker(small_settings(model="sim", api_key=key, lora_modules=["a"])) as w:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            resp = await w.client.post(path, json={"lora_name": "a"})
            assert resp.status_code == 401
        assert w.worker.loras.get("a") is not None
        auth = {"Authorization": f"Bearer {key}"}
        resp = await w.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=auth)
        assert resp.status_code == 200 and w.worker.loras.get("a") is None
