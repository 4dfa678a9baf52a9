"""Benchmark of symmetric pull: a holder-overloaded workload, mean TTFT with pull on vs off
(prints; asserts nothing).

    python -m loadtest.bench_pull [--groups 24] [--per-group 1] [--rate 3] [--repeats 2]

The scene: ``--nodes`` ``sim`` workers (both roles, p2p dialect) behind the proxy with the KV
router. Node ``a`` holds every group's system prompt (``--prefix-tokens``; it served them
before, the others joined empty) and a long "background" prefix. Background clients
(``--background`` of them, closed loop) keep ``a`` busy prefilling: each sends the background
prefix plus a fresh ``--background-suffix-tokens`` suffix through a second proxy replica that
fronts ``a`` alone (another tenant's pool) and shares the router state through Redis (a
redis-server this benchmark starts), so the measured proxy sees ``a``'s load. Meanwhile
``--groups`` x ``--per-group`` foreground requests (a group's system prompt + its own
question) arrive as a Poisson stream of ``--rate`` per second. Their prefix is on busy ``a``
alone: the router sends them to an idle node, which recomputes the prefix (pull off) or pulls
it from ``a`` over P2P (pull on). Same router, same cluster, same request sequence; only
``pull.enabled`` differs. Each run gets a fresh cluster; with ``--repeats N`` the variants
alternate (off, on, off, on...).

The router's link speed for the pull-on runs is measured first (``--calibrate-pulls``
concurrent pulls between two idle workers: bytes over wall time), unless
``--link-bytes-per-s`` gives one: the reference worker's pulls cost far more per byte than a
fast link would (handshake, offer, device-to-host copies of small pages in Python).

TTFT is the foreground requests', measured at the client from sending the request to the first
streamed token. Everything runs in this process (workers, proxy, clients): on a shared machine
the runs are noisy, hence the alternation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadtest.pull_cluster import PullCluster, pull_cluster
from loadtest.redis_server import own_redis_server

SIM_BLOCK_BYTES = 2 * 2 * 16 * 16
"""One block of the sim model: 2 KV-cache groups x 2 layers x 16 tokens x 16 bytes a row."""


@dataclass(frozen=True, slots=True)
class RunResult:
    label: str
    ttft_s: list[float]
    failed: int
    pulls: float
    pulled_bytes: int
    computed_tokens: int
    background: int
    """Background requests served meanwhile (all on ``a``)."""


def system_prompt(group: int, tokens: int) -> str:
    unit = f"[group {group:03d}] system prompt: policies, tools and examples. "
    return (unit * (tokens // len(unit) + 1))[:tokens]


def requests(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    out = [
        system_prompt(g, args.prefix_tokens) + f" Q{g}-{i}: " + "x" * args.question_tokens
        for g in range(args.groups)
        for i in range(args.per_group)
    ]
    rng.shuffle(out)
    return out


async def ttft(client: httpx.AsyncClient, text: str, output_tokens: int) -> float | None:
    body = {"prompt": text, "max_tokens": output_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return None
        first: float | None = None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line:
                first = time.perf_counter() - t0
        return first


BACKGROUND = -1
"""The background prefix's group number."""


async def warm(c: PullCluster, args: argparse.Namespace) -> None:
    """Node ``a`` computes every group's system prompt and the background prefix (sent to it
    directly), then the router's index shows them all on ``a``."""
    sem = asyncio.Semaphore(4)
    prompts = [system_prompt(g, args.prefix_tokens) for g in range(args.groups)]
    prompts.append(system_prompt(BACKGROUND, args.background_prefix_tokens))
    async with httpx.AsyncClient(base_url=c.nodes["a"].url, timeout=300) as direct:

        async def one(text: str) -> None:
            async with sem:
                resp = await direct.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
                resp.raise_for_status()

        await asyncio.gather(*(one(p) for p in prompts))
    deadline = time.monotonic() + 30
    for text in prompts:
        ids = list(text.encode())
        while not await c.holds("a", ids, (len(ids) - 1) // 16):
            if time.monotonic() > deadline:
                raise RuntimeError("node a's KV events did not reach the router")
            await asyncio.sleep(0.05)


async def background(
    client: httpx.AsyncClient, args: argparse.Namespace, stop: asyncio.Event, seed: int
) -> int:
    """One closed-loop background client until ``stop``; returns how many it sent."""
    rng = random.Random(seed)
    prefix = system_prompt(BACKGROUND, args.background_prefix_tokens)
    sent = 0
    while not stop.is_set():
        suffix = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(
            args.background_suffix_tokens))  # fmt: skip
        body = {"prompt": prefix + suffix, "max_tokens": 1}
        resp = await client.post("/v1/completions", json=body)
        resp.raise_for_status()
        sent += 1
    return sent


def _stat(c: PullCluster, name: str) -> int:
    return sum(int(getattr(n.worker.stats, name, 0)) for n in c.nodes.values())


def worker_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "sim_prefill_ms_per_token": args.prefill_ms_per_token,
        "sim_decode_ms_per_step": args.decode_ms_per_step,
        "num_pages": args.num_pages,
        "host_pages": args.num_pages,
        "max_model_len": 16384,
    }


async def calibrate(args: argparse.Namespace) -> float:
    """Bytes per second of ``--calibrate-pulls`` concurrent pulls from ``a`` to ``b`` (sent to
    ``b`` directly, both idle): the link speed as the reference worker achieves it here."""
    n = args.calibrate_pulls
    async with pull_cluster(("a", "b"), worker=worker_options(args)) as c:
        texts = [system_prompt(1000 + i, args.prefix_tokens) for i in range(n)]
        async with httpx.AsyncClient(base_url=c.nodes["a"].url, timeout=300) as direct:
            for text in texts:
                resp = await direct.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
                resp.raise_for_status()
        source = {
            "remote_host": "127.0.0.1",
            "remote_port": c.nodes["a"].connector.p2p_port,
            "remote_engine_id": c.nodes["a"].connector.engine_id,
        }
        async with httpx.AsyncClient(base_url=c.nodes["b"].url, timeout=300) as direct:

            async def pull(text: str) -> None:
                body = {
                    "prompt": text,
                    "max_tokens": 1,
                    "kv_transfer_params": {"remote_kv_source": source},
                }
                resp = await direct.post("/v1/completions", json=body)
                resp.raise_for_status()

            t0 = time.perf_counter()
            await asyncio.gather(*(pull(t) for t in texts))
            wall = time.perf_counter() - t0
        nbytes = c.nodes["b"].counter("pull_bytes")
        if nbytes <= 0:
            raise RuntimeError("calibration: the workers pulled nothing")
        return nbytes / wall


async def run(
    label: str, enabled: bool, args: argparse.Namespace, redis_url: str, link: float
) -> RunResult:
    pull = {
        "enabled": enabled,
        "block_bytes": SIM_BLOCK_BYTES,
        "prefill_tokens_per_s": 1000.0 / args.prefill_ms_per_token,
        "link_bytes_per_s": link,
    }
    worker = worker_options(args)
    names = tuple("abcdefgh"[: args.nodes])
    # A generous Redis deadline: this machine is shared, and a breaker opening would turn the
    # run into load-only routing.
    router = {"index_url": redis_url, "key_prefix": f"bench-{label}", "redis_deadline_s": 0.5}
    async with pull_cluster(names, pull=pull, worker=worker, router=router, side_proxy=("a",)) as c:
        assert c.side_url is not None
        await warm(c, args)
        computed0 = _stat(c, "prompt_tokens") - _stat(c, "prefix_hit_tokens")
        rng = random.Random(args.seed + 1)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        stop = asyncio.Event()
        async with (
            c.client(limits=limits) as client,
            httpx.AsyncClient(base_url=c.side_url, timeout=300, limits=limits) as side,
        ):
            loops = [
                asyncio.create_task(background(side, args, stop, args.seed + 100 + i))
                for i in range(args.background)
            ]
            await asyncio.sleep(args.background_lead_s)  # a's queue builds up first
            tasks = []
            for text in requests(args):
                tasks.append(asyncio.create_task(ttft(client, text, args.output_tokens)))
                await asyncio.sleep(rng.expovariate(args.rate))
            try:
                results = await asyncio.wait_for(asyncio.gather(*tasks), args.time_limit_s)
            finally:
                stop.set()
                counts = await asyncio.gather(*loops)
        pulls = sum(
            s.value
            for f in c.router.metrics.registry.collect()
            if f.name == "pdproxy_kv_pulls"
            for s in f.samples
            if s.name == "pdproxy_kv_pulls_total"
        )
        computed = _stat(c, "prompt_tokens") - _stat(c, "prefix_hit_tokens") - computed0
        return RunResult(
            label,
            [r for r in results if r is not None],
            sum(1 for r in results if r is None),
            pulls,
            _stat(c, "pull_bytes"),
            computed,
            sum(counts),
        )


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


async def main_async(args: argparse.Namespace) -> None:
    n = args.groups * args.per_group
    print(
        f"Holder-overloaded workload: {args.nodes} sim nodes, node a holds {args.groups} "
        f"system prompts of {args.prefix_tokens} tokens; {n} requests ({args.per_group} per "
        f"group, +{args.question_tokens}-token question, {args.output_tokens} output tokens) "
        f"at {args.rate:g} req/s while {args.background} background clients keep a busy "
        f"({args.background_prefix_tokens}-token prefix held by a + "
        f"{args.background_suffix_tokens} fresh tokens each); {args.prefill_ms_per_token} ms "
        f"per prefill token, {args.decode_ms_per_step} ms per decode step"
    )
    link = args.link_bytes_per_s or await calibrate(args)
    how = "given" if args.link_bytes_per_s else f"measured, {args.calibrate_pulls} pulls at once"
    print(f"  link speed for the pull cost: {link / 1e3:.0f} KB/s ({how})")
    results: list[RunResult] = []
    with own_redis_server() as redis_url:
        for r in range(args.repeats):
            for label, enabled in (("pull off", False), ("pull on", True)):
                results.append(await run(f"{label} #{r + 1}", enabled, args, redis_url, link))
    off = [x for x in results if x.label.startswith("pull off")]
    on = [x for x in results if x.label.startswith("pull on")]
    base = statistics.mean(statistics.mean(x.ttft_s) for x in off if x.ttft_s) or 1e-9
    print(
        f"  {'run':<12}{'mean TTFT':>11}{'p50':>9}{'p99':>9}{'ok':>5}{'fail':>5}"
        f"{'pulls':>7}{'pulled KiB':>12}{'computed tok':>14}{'bg reqs':>9}{'vs off':>8}"
    )
    for x in results:
        mean = statistics.mean(x.ttft_s) if x.ttft_s else 0.0
        print(
            f"  {x.label:<12}{mean * 1e3:>9.1f}ms{_pct(x.ttft_s, 0.5) * 1e3:>7.1f}ms"
            f"{_pct(x.ttft_s, 0.99) * 1e3:>7.1f}ms{len(x.ttft_s):>5}{x.failed:>5}"
            f"{x.pulls:>7.0f}{x.pulled_bytes / 1024:>12.1f}{x.computed_tokens:>14}"
            f"{x.background:>9}{mean / base:>7.2f}x"
        )
    mean_on = statistics.mean(statistics.mean(x.ttft_s) for x in on if x.ttft_s)
    print(f"  mean TTFT, pull on / pull off (same run): {mean_on / base:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--per-group", type=int, default=1)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=3.0, help="foreground requests per second")
    parser.add_argument("--background", type=int, default=6, help="background clients on a")
    parser.add_argument("--background-prefix-tokens", type=int, default=8192)
    parser.add_argument("--background-suffix-tokens", type=int, default=512)
    parser.add_argument("--background-lead-s", type=float, default=2.0)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.5)
    parser.add_argument("--decode-ms-per-step", type=float, default=4.0)
    parser.add_argument("--num-pages", type=int, default=8192, help="device pages per worker")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--link-bytes-per-s", type=float, default=0.0, help="0: measure it")
    parser.add_argument("--calibrate-pulls", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--time-limit-s", type=float, default=300.0, help="per run")
    args = parser.parse_args()
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
