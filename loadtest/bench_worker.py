"""Benchmark: time to first token of a PD request — warm producer vs cold producer vs single node.

    python -m loadtest.bench_worker [--tokens 2048] [--repeat 5] [--model tiny]

Three in-process workers (producer, consumer, single node; P2P over loopback TCP) serve a long
prompt, a fresh one per measurement so nothing is cached by accident:

- single node: one streaming request to a worker that never saw the prompt;
- PD cold: producer leg (prefill) then streaming consumer leg (fetch over P2P, decode);
- PD warm: the producer served the prompt before (its prefix cache holds it), then the same PD.

TTFT is measured at the first streamed token of the client-facing leg (PD: from the start of the
producer leg). Prints medians, ratios against single node measured in the same run, and bytes the
consumer fetched per request. Asserts nothing; bounded by --repeat and --time-limit-s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.worker import Worker


@contextlib.asynccontextmanager
async def in_process(settings: WorkerSettings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=300) as c:
            yield app, c


async def first_token_s(client: httpx.AsyncClient, body: dict[str, Any], t0: float) -> float:
    """Seconds from ``t0`` to the first streamed token; reads the stream to its end."""
    ttft: float | None = None
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


async def pd_ttft(
    producer: httpx.AsyncClient, consumer: httpx.AsyncClient, body: dict[str, Any]
) -> float:
    t0 = time.perf_counter()
    kv_request_id = uuid.uuid4().hex
    leg = {
        **body,
        "max_tokens": 1,
        "kv_transfer_params": {"remote_decoder": {"kv_request_id": kv_request_id}},
    }
    resp = await producer.post("/v1/completions", json=leg)
    resp.raise_for_status()
    params = resp.json()["kv_transfer_params"]
    consumer_params = {
        "remote_prefiller": {
            "kv_request_id": params["kv_request_id"],
            "remote_host": params["remote_host"],
            "remote_port": params["remote_port"],
        }
    }
    return await first_token_s(consumer, {**body, "kv_transfer_params": consumer_params}, t0)


def prompt(rng: random.Random, tokens: int) -> str:
    return "".join(chr(rng.randrange(32, 127)) for _ in range(tokens))


async def run(args: argparse.Namespace) -> None:
    pages = (args.tokens // 16 + 8) * (args.repeat + 2) * 2
    common = {
        "model": args.model,
        "num_pages": pages,
        "host_pages": pages,
        "max_model_len": args.tokens + 64,
        "max_batched_tokens": args.tokens + 64,
    }
    rng = random.Random(0)
    samples: dict[str, list[float]] = {
        "single node": [],
        "PD cold producer": [],
        "PD warm producer": [],
    }
    fetched: dict[str, list[int]] = {"PD cold producer": [], "PD warm producer": []}
    async with (
        in_process(WorkerSettings(role="producer", **common)) as (_, producer),
        in_process(WorkerSettings(role="consumer", **common)) as (consumer_app, consumer),
        in_process(WorkerSettings(role="both", **common)) as (_, single),
    ):
        stats = consumer_app.state.worker
        assert isinstance(stats, Worker)
        body = {"max_tokens": args.max_tokens, "temperature": 0}
        # Warm-up (imports, first allocations) outside the measurements.
        await first_token_s(single, {**body, "prompt": prompt(rng, 64)}, time.perf_counter())
        deadline = time.monotonic() + args.time_limit_s
        for _ in range(args.repeat):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            samples["single node"].append(
                await first_token_s(single, {**body, "prompt": prompt(rng, args.tokens)}, t0)
            )
            for name, warm in (("PD cold producer", False), ("PD warm producer", True)):
                p = prompt(rng, args.tokens)
                if warm:
                    (
                        await producer.post(
                            "/v1/completions", json={**body, "prompt": p, "max_tokens": 1}
                        )
                    ).raise_for_status()
                before = stats.stats.p2p_bytes_fetched
                samples[name].append(await pd_ttft(producer, consumer, {**body, "prompt": p}))
                fetched[name].append(stats.stats.p2p_bytes_fetched - before)
        s = stats.stats
        print(
            f"model {args.model}, prompt {args.tokens} tokens, {len(samples['single node'])} "
            f"runs each; consumer recomputed {s.recomputed_tokens} tokens, "
            f"fetch failures {s.p2p_fetch_failures}"
        )
    base = statistics.median(samples["single node"])
    print(f"{'case':20} {'TTFT p50 ms':>12} {'min ms':>8} {'x single':>9} {'KiB fetched':>12}")
    for name, values in samples.items():
        kib = statistics.median(fetched[name]) / 1024 if name in fetched else 0.0
        med = statistics.median(values)
        print(
            f"{name:20} {med * 1000:12.1f} {min(values) * 1000:8.1f} {med / base:9.2f} {kib:12.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["tiny", "sim"], default="tiny")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--time-limit-s", type=float, default=120.0)
    logging.basicConfig(level=logging.ERROR)  # the loopback-only P2P warning is expected here
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
