"""Benchmark of the KV-aware router (prints; asserts nothing).

    python -m loadtest.bench_router [--decisions 2000] [--nodes 1024 [--all-candidates]]
        [--workload] [--redis-url URL] [--kv-option local_prefill.max_suffix_tokens=0 ...]

1. Decision time for an 8,192-token prompt over 8 candidates (4 producers + 4 consumers, each
   holding a random prefix of the prompt) among ``--nodes`` nodes in the index (one in eight of
   the others holds a prefix of it too, the rest other prompts); ``--all-candidates`` ranks all
   of them: the router's ``decide`` (hash + match + score) and its whole
   ``route`` (plus load charge and prediction writes), p50/p99, with the in-memory index and with
   Redis. Baseline measured in the same run: hashing alone, and one Redis PING round trip.
   Redis: ``--redis-url`` or a redis-server this benchmark starts on a free port and stops.
2. ``--workload``: a shared-prefix workload (``--groups`` x ``--per-group`` prompts sharing a
   ``--system-tokens`` system prompt) on real ``sim`` workers (2 producers + 2 consumers, prefill
   time proportional to uncached tokens) behind the real proxy, started by ``pdproxy.stack`` once
   per router: mean/p99 TTFT and prefix hit rate for KV-aware vs round-robin vs least-loaded.
   Prefix hit rate: 1 - (prompt tokens the workers computed) / (prompt tokens of the requests),
   where computed = admitted - cached (local prefix hits and blocks received over P2P), summed
   over both legs of every request.
   Each router's run is bounded by ``--time-limit-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from collections.abc import Iterator

import httpx
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvtier.events import BlockStored, EventBatch
from kvtier.keys import BlockHash, BlockHasher
from kvtier.residency.redis_index import RedisIndex
from kvtier.residency.types import NodeId
from loadtest.redis_server import own_redis_server
from pdproxy.routing.base import RequestOutcome, Role, RouteRequest
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.settings import KvRouterSettings

SEED = "bench-model"
BLOCK = 16


class _Backend:
    def __init__(self, name: str, role: Role) -> None:
        self.name = name
        self.role = role
        self.url = "http://127.0.0.1:9"
        self.routable = True
        self.in_flight = 0


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _row(name: str, samples_ms: list[float], base_ms: float | None = None) -> str:
    p50, p99 = _pct(samples_ms, 0.5), _pct(samples_ms, 0.99)
    ratio = f"  ({p50 / base_ms:5.1f}x baseline p50)" if base_ms else ""
    return f"  {name:<38} p50 {p50 * 1000:8.1f} µs   p99 {p99 * 1000:8.1f} µs{ratio}"


async def _populate(
    router: KvRouter,
    hashes: list[BlockHash],
    prompt: list[int],
    names: list[str],
    rng: random.Random,
) -> None:
    """Each node holds a random prefix of the prompt (one in eight of the nodes past the first
    eight) or of a prompt of its own (the rest: idle for this prompt). Shared state: written
    as each node's stream writer (its lease taken first)."""
    leases = router.state.leases
    for i, name in enumerate(names):
        node = NodeId(name)
        if i < 8 or i % 8 == 0:
            tokens = prompt
        else:
            tokens = [rng.randrange(0, 128_000) for _ in range(len(prompt))]
        n = rng.randrange(1, len(hashes) + 1) * BLOCK
        own = hashes if tokens is prompt else BlockHasher(SEED, BLOCK).hash_tokens(tokens[:n])
        event = BlockStored(tuple(own[: n // BLOCK]), None, tuple(tokens[:n]), BLOCK)
        batch = EventBatch(0.0, (event,))
        if leases is None:
            await router.state.index.apply(node, batch)
        else:
            await leases.take(node)
            await leases.apply(node, batch, seq=0)


async def _measure(
    router: KvRouter, decisions: int, seed: int, nodes: int, all_candidates: bool
) -> tuple[list[float], list[float], list[float]]:
    """Decide and route times (ms), and the index's ``match`` alone on the same state."""
    rng = random.Random(seed)
    prompt = [rng.randrange(0, 128_000) for _ in range(8192)]
    hashes = BlockHasher(SEED, BLOCK).hash_tokens(prompt)
    names = [f"p{i}" if i % 2 == 0 else f"c{i}" for i in range(max(nodes, 8))]
    await _populate(router, hashes, prompt, names, rng)
    chosen = names if all_candidates else names[:8]
    producers = [_Backend(n, Role.PRODUCER) for n in chosen if n.startswith("p")]
    consumers = [_Backend(n, Role.CONSUMER) for n in chosen if n.startswith("c")]
    decide, route = [], []
    for i in range(decisions + 50):
        req = RouteRequest(f"b{i}", "completions", {"prompt": prompt})
        t0 = time.perf_counter()
        d = await router.route(req, producers, consumers)
        elapsed = (time.perf_counter() - t0) * 1000
        await router.finished(d, RequestOutcome(None, None, ok=True))
        if i >= 50:  # warm-up
            decide.append(float(d.explain["decide_ms"]))
            route.append(elapsed)
    match = []
    for _ in range(decisions):
        t0 = time.perf_counter()
        await router.state.index.match(hashes)
        match.append((time.perf_counter() - t0) * 1000)
    return decide, route, match


async def _decision_time(
    decisions: int, redis_url: str | None, nodes: int, all_candidates: bool
) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(0, 128_000) for _ in range(8192)]
    hasher = BlockHasher(SEED, BLOCK)
    hash_ms = []
    for _ in range(decisions):
        t0 = time.perf_counter()
        hasher.hash_tokens(prompt)
        hash_ms.append((time.perf_counter() - t0) * 1000)
    base = _pct(hash_ms, 0.5)
    scored = f"all {max(nodes, 8)} as candidates" if all_candidates else "8 candidates (4P+4C)"
    print(
        f"Decision time, 8,192-token prompt, {max(nodes, 8)} nodes in the index "
        f"(the first 8 and one in eight of the others hold random prefixes of it), {scored}"
    )
    print(_row("baseline: hashing alone", hash_ms))

    settings = KvRouterSettings(model_seed=SEED, block_size=BLOCK)
    router = build_kv_router(settings, metrics_registry=CollectorRegistry())
    await router.start()
    try:
        decide, route, match = await _measure(router, decisions, 2, nodes, all_candidates)
    finally:
        await router.close()
    print(_row("memory: index.match alone", match))
    print(_row("memory: decide (hash+match+score)", decide, base))
    print(_row("memory: route (+charge, +predict)", route, base))

    with contextlib.ExitStack() as stack:
        url = redis_url or stack.enter_context(own_redis_server())
        settings = KvRouterSettings(model_seed=SEED, block_size=BLOCK, index_url=url)
        router = build_kv_router(settings, metrics_registry=CollectorRegistry())
        await router.start()
        try:
            ping = []
            index = router.state.index
            assert isinstance(index, RedisIndex)
            for _ in range(decisions):
                t0 = time.perf_counter()
                await index.ping()
                ping.append((time.perf_counter() - t0) * 1000)
            decide, route, match = await _measure(router, decisions, 2, nodes, all_candidates)
            fallbacks = router.metrics.registry.get_sample_value(
                "pdproxy_kv_router_fallbacks_total"
            )
        finally:
            await router.close()
        print(_row("baseline: redis PING round trip", ping))
        print(_row("redis: index.match alone", match))
        print(_row("redis: decide (hash+match+load+score)", decide, base))
        print(_row("redis: route (+charge, +predict)", route, base))
        print(f"  redis fallbacks during the run: {fallbacks or 0:.0f}")
    print("  targets: decide p99 <= 500 µs (memory), <= 2000 µs (redis)")
    print(f"  ({decisions} decisions each after 50 warm-up; p50/p99 from raw samples)")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the stack started inside (the proxy reads its router
    options from ``PDPROXY_ROUTER_OPTIONS__*`` on top of its config file)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker_counters(urls: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("kvtier_worker_") and sample.name.endswith("_total"):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _workload(args: argparse.Namespace) -> None:
    from loadtest.bench_client import BenchConfig, run_benchmark
    from loadtest.local_stack import local_stack
    from loadtest.serving_metrics import summarize
    from loadtest.workloads import RequestOptions, WorkloadConfig, WorkloadKind

    print(
        f"\nShared-prefix workload: {args.groups} groups x {args.per_group} prompts, "
        f"{args.system_tokens}-token system prompt + {args.question_tokens}-token question, "
        f"{args.output_tokens} output tokens, {args.rate:g} req/s; sim workers 2P+2C, "
        f"{args.prefill_ms_per_token} ms per uncached prefill token, {args.num_pages} pages"
    )
    rows: dict[str, tuple[float, float, float, int, int]] = {}
    variant_env = {
        "PDPROXY_ROUTER_OPTIONS__" + key.replace(".", "__").upper(): value
        for key, _, value in (opt.partition("=") for opt in args.kv_option)
    }
    runs: list[tuple[str, str, dict[str, str]]] = [("kv", "kv", {})]
    if variant_env:
        runs.append(("kv+options", "kv", variant_env))
    runs += [("round_robin", "round_robin", {}), ("least_loaded", "least_loaded", {})]
    for label, router, env in runs:
        stack_args = [
            "--producers", "2", "--consumers", "2", "--model", "sim", "--router", router,
            f"--worker-arg=--sim-prefill-ms-per-token={args.prefill_ms_per_token}",
            f"--worker-arg=--sim-decode-ms-per-step={args.decode_ms_per_step}",
            f"--worker-arg=--num-pages={args.num_pages}",
            "--worker-arg=--max-model-len=4096",
        ]  # fmt: skip
        with _environment(env), local_stack(stack_args) as stack:
            config = yaml.safe_load((stack.log_path.parent / "run" / "proxy.yaml").read_text())
            urls = [b["url"] for b in config["backends"]]
            before = _worker_counters(urls)
            workload = WorkloadConfig(
                kind=WorkloadKind.SHARED_PREFIX,
                groups=args.groups,
                prompts_per_group=args.per_group,
                system_prompt_len=args.system_tokens,
                question_len=args.question_tokens,
                options=RequestOptions(model=stack.model, output_len=args.output_tokens),
            )
            bench = BenchConfig(
                base_url=stack.endpoint, request_rate=args.rate, max_duration_s=args.time_limit_s
            )
            outcome = asyncio.run(run_benchmark(bench, workload))
            after = _worker_counters(urls)
        summary = summarize(outcome.records, outcome.duration_s, detailed=False)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        admitted = delta.get("kvtier_worker_prompt_tokens_total", 0.0)
        hits = delta.get("kvtier_worker_prefix_hit_tokens_total", 0.0)
        client = float(summary["total_input_tokens"]) or 1.0
        computed = max(admitted - hits, 0.0)  # a worker's hits include blocks fetched over P2P
        rows[label] = (
            summary["mean_ttft_ms"],
            summary["p99_ttft_ms"],
            1.0 - computed / client,
            summary["completed"],
            summary["failed"] + outcome.cancelled,
        )
    rr_mean = rows["round_robin"][0] or 1e-9
    print(f"  {'router':<14}{'mean TTFT':>12}{'p99 TTFT':>12}{'hit rate':>10}"
          f"{'ok':>6}{'failed':>8}{'mean vs RR':>12}")  # fmt: skip
    for router, (mean, p99, hit, ok, bad) in rows.items():
        print(f"  {router:<14}{mean:>10.1f}ms{p99:>10.1f}ms{hit:>10.1%}{ok:>6}{bad:>8}"
              f"{mean / rr_mean:>11.2f}x")  # fmt: skip
    if variant_env:
        print(f"  kv+options: {' '.join(args.kv_option)}")
    print("  target: KV-aware mean TTFT <= 0.5x round-robin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--nodes", type=int, default=8, help="nodes in the index (>= 8)")
    parser.add_argument(
        "--all-candidates", action="store_true", help="every node is a routing candidate"
    )
    parser.add_argument("--workload", action="store_true", help="also run the sim workload")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--decode-ms-per-step", type=float, default=2.0)
    parser.add_argument("--num-pages", type=int, default=2304, help="device pages per worker")
    parser.add_argument("--time-limit-s", type=float, default=150, help="per router")
    parser.add_argument(
        "--kv-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="adds a KV-aware run with this router option changed, e.g. "
        "weights.in_flight_tokens=0 or local_prefill.max_suffix_tokens=0 (repeatable)",
    )
    args = parser.parse_args()
    asyncio.run(_decision_time(args.decisions, args.redis_url, args.nodes, args.all_candidates))
    if args.workload:
        _workload(args)


if __name__ == "__main__":
    main()
