"""Two models and a LoRA adapter behind one proxy, with real reference workers (``sim``) as HTTP
servers publishing real KV events, under mixed shared-prefix traffic:

- every answer comes from a worker serving the requested model (a worker answers another
  model's request with 404, and names the model it ran), with zero errors;
- the KV router's hit rate per model (prefix-cache tokens the serving worker reported, over
  prompt tokens) is as good as that of the same model's traffic through a one-model proxy
  (requests one at a time, so that the rate measures routing, not concurrent siblings racing
  their prefix; round robin is measured alongside as the floor);
- an unknown model is OpenAI's 404; the official ``openai`` SDK works against the stack.

Aggregated workers (``role: both``, dialect ``none``) so that the tokens a worker reports
cached are its own prefix-cache hits, i.e. the router's doing. The measured rates are printed
(``-s``) and kept in ``MEASURED`` for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from kvtier.worker.server.app import create_app as create_worker_app
from kvtier.worker.settings import WorkerSettings
from tests.conftest import free_port
from tests.pdproxy.conftest import ProxyFactory, _InProcessServer, quick_settings

pytestmark = pytest.mark.slow

GROUPS = 5
PER_GROUP = 6
SYSTEM_CHARS = 192  # 12 blocks of 16 byte-tokens


@dataclass
class WorkerProc:
    name: str
    model: str
    url: str
    events: str
    server: uvicorn.Server
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def workers(specs: list[tuple[str, str, list[str]]]) -> AsyncIterator[list[WorkerProc]]:
    """``(name, served model, adapters)`` sim workers on free ports, stopped at exit."""
    started: list[WorkerProc] = []
    try:
        for name, model, adapters in specs:
            port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
            settings = WorkerSettings(
                model="sim", served_model_name=model, lora_modules=adapters, role="both",
                host="127.0.0.1", port=port, events_endpoint=events, engine_id=name,
                num_pages=512, host_pages=64, max_model_len=1024,
            )  # fmt: skip
            config = uvicorn.Config(
                create_worker_app(settings), host="127.0.0.1", port=port, loop="none",
                access_log=False, log_level="warning", lifespan="on",
            )  # fmt: skip
            server = _InProcessServer(config)
            task = asyncio.get_running_loop().create_task(server.serve())
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
            started.append(
                WorkerProc(name, model, f"http://127.0.0.1:{port}", events, server, task)
            )
        yield started
    finally:
        for w in started:
            w.server.should_exit = True
        for w in started:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(w.task, 15)


def entries(procs: list[WorkerProc], *, with_models: bool) -> list[dict[str, Any]]:
    out = []
    for w in procs:
        entry: dict[str, Any] = {
            "name": w.name, "url": w.url, "role": "both", "dialect": "none",
            "events_endpoint": w.events,
        }  # fmt: skip
        if with_models:
            entry["models"] = [w.model, *(["style"] if w.model == "alpha" else [])]
        out.append(entry)
    return out


def kv_settings(backends: list[dict[str, Any]], **extra: Any) -> Any:
    return quick_settings(
        backends,
        router="kv",
        router_options={"model_seed": "sys", "block_size": 16, "tokenizer": {"kind": "bytes"}},
        **extra,
    )


MULTI = {"served": {"alpha": {}, "beta": {}, "style": {"base": "alpha"}}}


def workload(model: str, salt: str) -> Iterator[dict[str, Any]]:
    """Shared-prefix groups: each group's prompts share a long system prefix."""
    for g in range(GROUPS):
        system = (f"[{salt} {model} group {g}] You are a careful assistant. " * 8)[:SYSTEM_CHARS]
        for q in range(PER_GROUP):
            yield {
                "model": model, "prompt": system + f"Question {q}: what is {g} + {q}?",
                "max_tokens": 4, "temperature": 0,
            }  # fmt: skip


@dataclass
class Tally:
    prompt: int = 0
    cached: int = 0
    errors: int = 0
    wrong_model: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0


async def run(url: str, bodies: list[dict[str, Any]], concurrency: int = 1) -> dict[str, Tally]:
    tallies: dict[str, Tally] = {}
    queue = list(bodies)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one() -> None:
            while queue:
                body = queue.pop(0)
                t = tallies.setdefault(body["model"], Tally())
                resp = await client.post("/v1/completions", json=body)
                if resp.status_code != 200:
                    t.errors += 1
                    continue
                answer = resp.json()
                if answer["model"] != body["model"]:
                    t.wrong_model += 1
                usage = answer["usage"]
                t.prompt += usage["prompt_tokens"]
                t.cached += usage["prompt_tokens_details"]["cached_tokens"]

        await asyncio.gather(*(one() for _ in range(concurrency)))
    return tallies


def interleaved(*streams: list[dict[str, Any]], seed: int = 7) -> list[dict[str, Any]]:
    """Mixed traffic: the streams' requests shuffled together, each stream's order kept."""
    rng = random.Random(seed)
    pending = [list(s) for s in streams]
    out = []
    while any(pending):
        stream = rng.choice([s for s in pending if s])
        out.append(stream.pop(0))
    return out


MEASURED: dict[str, float] = {}


async def test_two_models_and_an_adapter_under_mixed_traffic(proxy: ProxyFactory) -> None:
    specs = [("a0", "alpha", ["style"]), ("a1", "alpha", ["style"])]
    specs += [("b0", "beta", []), ("b1", "beta", [])]
    async with workers(specs) as procs:
        alone = await proxy(kv_settings(entries(procs[:2], with_models=False)))
        baseline = await run(alone.url, list(workload("alpha", "alone")))
        alone.server.should_exit = True
        rr = await proxy(quick_settings(entries(procs[:2], with_models=False)))
        round_robin = await run(rr.url, list(workload("alpha", "round-robin")))
        rr.server.should_exit = True
        mixed = await proxy(kv_settings(entries(procs, with_models=True), models=MULTI))
        streams = [list(workload(m, "mixed")) for m in ("alpha", "beta", "style")]
        tallies = await run(mixed.url, interleaved(*streams))
        async with httpx.AsyncClient(base_url=mixed.url) as client:
            unknown = await client.post("/v1/completions", json={"model": "gamma", "prompt": "x"})
            metrics = (await client.get("/metrics")).text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    MEASURED["alpha alone"] = baseline["alpha"].hit_rate
    MEASURED["alpha alone, round robin"] = round_robin["alpha"].hit_rate
    for model, t in tallies.items():
        MEASURED[f"{model} mixed"] = t.hit_rate
    print("\nKV hit rate (cached/prompt tokens):", {k: round(v, 3) for k, v in MEASURED.items()})
    assert set(tallies) == {"alpha", "beta", "style"}
    for model, t in tallies.items():
        assert t.errors == 0 and t.wrong_model == 0, (model, t)
    # The ideal: every prompt but a group's first finds its 12 system blocks cached.
    for model in ("alpha", "beta", "style"):
        assert tallies[model].hit_rate >= 0.95 * baseline["alpha"].hit_rate, MEASURED
    assert 'pdproxy_model_requests_total{model="style",status="200"}' in metrics
    assert 'pdproxy_kv_router_decisions_total{model="beta",reason=' in metrics


async def test_openai_sdk_against_a_multi_model_proxy(proxy: ProxyFactory) -> None:
    specs = [("a0", "alpha", ["style"]), ("b0", "beta", [])]
    async with workers(specs) as procs:
        px = await proxy(kv_settings(entries(procs, with_models=True), models=MULTI))
        client = openai.AsyncOpenAI(base_url=px.url + "/v1", api_key="unused", max_retries=0)
        try:
            listed = [m.id async for m in client.models.list()]
            texts = {}
            for model in ("alpha", "beta", "style"):
                done = await client.completions.create(
                    model=model, prompt="Say something", max_tokens=6, temperature=0
                )
                assert done.model == model and done.usage is not None
                texts[model] = done.choices[0].text
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                    stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
                chunks = [c async for c in stream]
                assert {c.model for c in chunks} == {model}
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
            with pytest.raises(openai.NotFoundError) as err:
                await client.completions.create(model="gamma", prompt="x", max_tokens=1)
        finally:
            await client.close()
    assert sorted(listed) == ["alpha", "beta", "style"]
    assert len(set(texts.values())) == 3  # the adapter's text is its own
    assert err.value.code == "model_not_found" and "gamma" in err.value.message
