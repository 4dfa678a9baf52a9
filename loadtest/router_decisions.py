"""One decision-time measurement of the KV router, run as a child process of
:mod:`loadtest.bench_router` (prints one JSON line; asserts nothing).

    PYTHONPATH=TREE python loadtest/router_decisions.py --backend memory|redis \
        [--redis-url URL] [--decisions 500] [--nodes 1024] [--all-candidates] [--deadline-s S]

Run by path with ``PYTHONPATH`` naming a source tree, it measures that tree's router: the
benchmark runs it for this tree and for a baseline tree (the code before a change) in the same
run. So it imports nothing from ``loadtest`` and uses only the router's public API, which both
trees share.

The state: an 8,192-token prompt; ``--nodes`` nodes in the index; the first 8 and one in
eight of the others hold a random prefix of the prompt, the rest a prefix of a prompt of
their own (idle for this prompt). The candidates: the first 8 (4 producers + 4 consumers), or
all nodes with ``--all-candidates``. Samples (ms): ``decide`` (hash + match + load + score, the
router's own clock), ``route`` (+ charge and predictions), ``match`` (the index alone, among the
candidates when the tree's index takes them), ``cpu`` (process CPU per route), ``hash``
(hashing the prompt alone) and, with Redis, ``ping`` (one round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import random
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.errors import ResidencyUnavailable
from kvtier.events import BlockStored, EventBatch
from kvtier.keys import BlockHash, BlockHasher
from kvtier.residency.types import NodeId
from pdproxy.routing.base import RequestOutcome, Role, RouteRequest
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings

BLOCK = 16
TOKENS = 8192
WARMUP = 50


class _Backend:
    def __init__(self, name: str, role: Role) -> None:
        self.name = name
        self.role = role
        self.url = "http://127.0.0.1:9"
        self.routable = True
        self.in_flight = 0


async def _populate(
    router: KvRouter, seed: str, hashes: list[BlockHash], prompt: list[int], names: list[str]
) -> None:
    """Shared state: written as each node's stream writer (its lease taken first)."""
    rng = random.Random(3)
    hasher = BlockHasher(seed, BLOCK)
    leases = router.state.leases
    for i, name in enumerate(names):
        node = NodeId(name)
        ours = i < 8 or i % 8 == 0
        tokens = prompt if ours else [rng.randrange(0, 128_000) for _ in range(len(prompt))]
        n = rng.randrange(1, len(hashes) + 1) * BLOCK
        own = hashes if ours else hasher.hash_tokens(tokens[:n])
        event = BlockStored(tuple(own[: n // BLOCK]), None, tuple(tokens[:n]), BLOCK)
        batch = EventBatch(0.0, (event,))
        for attempt in range(5):  # a busy machine may miss the 500 ms apply deadline
            try:
                if leases is None:
                    await router.state.index.apply(node, batch)
                else:
                    await leases.take(node)
                    await leases.apply(node, batch, seq=0)
                break
            except ResidencyUnavailable:
                if attempt == 4:
                    raise


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    seed = f"bench-{uuid.uuid4().hex[:8]}"  # a model (and Redis hash tag) of its own
    rng = random.Random(2)
    prompt = [rng.randrange(0, 128_000) for _ in range(TOKENS)]
    hasher = BlockHasher(seed, BLOCK)
    samples: dict[str, list[float]] = {k: [] for k in ("hash", "decide", "route", "cpu", "match")}
    for _ in range(args.decisions):
        t0 = time.perf_counter()
        hasher.hash_tokens(prompt)
        samples["hash"].append((time.perf_counter() - t0) * 1000)
    hashes = hasher.hash_tokens(prompt)
    url = args.redis_url if args.backend == "redis" else None
    router = build_kv_router(
        KvRouterSettings(
            model_seed=seed, block_size=BLOCK, index_url=url, redis_deadline_s=args.deadline_s
        ),
        metrics_registry=CollectorRegistry(),
    )
    await router.start()
    try:
        index = router.state.index
        if args.backend == "redis":
            for _ in range(50):  # the first call connects within the deadline: a busy
                with contextlib.suppress(ResidencyUnavailable):  # machine may need a retry
                    await index.ping()  # type: ignore[attr-defined]
                    break
            samples["ping"] = []
            for _ in range(args.decisions):
                t0 = time.perf_counter()
                await index.ping()  # type: ignore[attr-defined]
                samples["ping"].append((time.perf_counter() - t0) * 1000)
        names = [f"p{i}" if i % 2 == 0 else f"c{i}" for i in range(max(args.nodes, 8))]
        await _populate(router, seed, hashes, prompt, names)
        chosen = names if args.all_candidates else names[:8]
        producers = [_Backend(n, Role.PRODUCER) for n in chosen if n.startswith("p")]
        consumers = [_Backend(n, Role.CONSUMER) for n in chosen if n.startswith("c")]
        for i in range(args.decisions + WARMUP):
            req = RouteRequest(f"b{i}", "completions", {"prompt": prompt})
            c0, t0 = time.process_time(), time.perf_counter()
            d = await router.route(req, producers, consumers)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            await router.finished(d, RequestOutcome(None, None, ok=True))
            if i >= WARMUP:
                samples["decide"].append(float(d.explain["decide_ms"]))
                samples["route"].append(elapsed * 1000)
                samples["cpu"].append(cpu * 1000)
        among = "among" in inspect.signature(index.match).parameters
        candidates = [NodeId(n) for n in chosen]
        for _ in range(args.decisions):
            t0 = time.perf_counter()
            if among:
                await index.match(hashes, candidates)
            else:
                await index.match(hashes)
            samples["match"].append((time.perf_counter() - t0) * 1000)
        fallbacks = router.metrics.registry.get_sample_value("pdproxy_kv_router_fallbacks_total")
    finally:
        await router.close()
    return {"samples": samples, "fallbacks": fallbacks or 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["memory", "redis"], required=True)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--decisions", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--all-candidates", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=0.02, help="redis_deadline_s")
    args = parser.parse_args()
    if args.backend == "redis" and not args.redis_url:
        parser.error("--backend redis needs --redis-url")
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()
