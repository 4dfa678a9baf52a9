"""Benchmark: time to first token when a node pulls a prefix from its holder (symmetric pull,
``remote_kv_source``) vs recomputing it, in one run (prints; asserts nothing).

    python -m loadtest.bench_worker_pull [--model tiny|sim] [--prompt-tokens 1500] [--repeat 5]
                                  [--tiny-hidden 256] [--tiny-layers 8]
                                  [--sim-prefill-ms-per-token 0.2]

Two reference workers in this process (HTTP in process over ASGI, P2P over real loopback
sockets, integrity on): a HOLDER and a free node. For each repetition a fresh prompt (no block
shared with earlier ones) is

1. computed on the holder (it is warm from then on),
2. sent to the free node plainly: it **recomputes** the whole prompt,
3. sent, salted (the same tokens, no block in common with step 2), to the free node with
   ``remote_kv_source`` naming the holder: it **pulls** every usable block and computes only
   the last token,
4. sent again to the holder: a **local hit** (the floor).

TTFT is a non-streamed request with ``max_tokens=1``. Prints medians (best in brackets) and
the ratios pull/recompute and local/recompute, measured side by side. With ``--model tiny``
the prefill is real arithmetic on this CPU; with ``--model sim`` it follows the latency model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

from kvtier.worker.p2p_connector import P2PConnector
from kvtier.worker.server.app import create_app
from kvtier.worker.settings import WorkerSettings


@contextlib.asynccontextmanager
async def worker(settings: WorkerSettings) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://worker", timeout=600
        ) as client:
            yield client, app.state.worker


async def ttft(client: httpx.AsyncClient, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    resp = await client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - started
    resp.raise_for_status()
    return elapsed


def prompt(n_tokens: int) -> str:
    tag = uuid.uuid4().hex
    text = f"[{tag}] " + "Pull the prefix from the node that holds it. " * (n_tokens // 40 + 1)
    return text[:n_tokens]


async def run(args: argparse.Namespace) -> None:
    base: dict[str, Any] = {
        "model": args.model,
        "num_pages": 4096,
        "host_pages": 4096,
        "max_model_len": args.prompt_tokens + 64,
        "max_batched_tokens": max(2048, args.prompt_tokens + 16),
        "tiny_hidden": args.tiny_hidden,
        "tiny_layers": args.tiny_layers,
        "tiny_ffn": args.tiny_hidden * 2,
        "dtype": "float32",
        "sim_prefill_ms_per_token": args.sim_prefill_ms_per_token,
        "p2p_secret": "bench-pull-" + uuid.uuid4().hex,
    }
    times: dict[str, list[float]] = {"recompute": [], "pull": [], "local hit": []}
    pulled = 0.0
    async with (
        worker(WorkerSettings(role="both", **base)) as (holder, holder_worker),
        worker(WorkerSettings(role="consumer", **base)) as (free, free_worker),
    ):
        conn = holder_worker.connector
        assert isinstance(conn, P2PConnector)
        source = {
            "remote_host": "127.0.0.1",
            "remote_port": conn.p2p_port,
            "remote_engine_id": conn.engine_id,
        }
        for i in range(args.repeat + 1):  # the first round warms both (torch, sessions)
            body = {"prompt": prompt(args.prompt_tokens), "max_tokens": 1, "temperature": 0}
            await ttft(holder, body)
            recompute = await ttft(free, body)
            pull_body = {**body, "cache_salt": "pull", "kv_transfer_params": {
                "remote_kv_source": source}}  # fmt: skip
            await ttft(holder, {**body, "cache_salt": "pull"})  # the holder holds this one
            pull = await ttft(free, pull_body)
            local = await ttft(holder, body)
            if i:
                times["recompute"].append(recompute)
                times["pull"].append(pull)
                times["local hit"].append(local)
        pulled = free_worker.stats.pull_bytes / max(free_worker.stats.pull_requests, 1)
        failures = free_worker.stats.pull_failures
    rec = statistics.median(times["recompute"])
    print(
        f"model={args.model} prompt={args.prompt_tokens} tokens repeat={args.repeat} "
        f"pulled {pulled / 2**20:.2f} MiB per request, pull failures {failures}"
    )
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"  {name:<10} TTFT {med * 1000:8.1f} ms (best {min(values) * 1000:.1f})"
            f"   {med / rec:5.2f}x recompute"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "sim"], default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tiny-hidden", type=int, default=256)
    parser.add_argument("--tiny-layers", type=int, default=8)
    parser.add_argument("--sim-prefill-ms-per-token", type=float, default=0.2)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
