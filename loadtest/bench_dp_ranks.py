"""Rank-aware vs rank-blind routing over data-parallel workers (prints; asserts nothing).

    python -m loadtest.bench_dp_ranks [--workers 2] [--dp 2] [--groups 8] [--rounds 6]
        [--prefix-tokens 1024] [--num-pages 240] [--concurrency 4] [--time-limit-s 60] [--seed 1]

``--workers`` aggregated ``sim`` reference workers (role both, dialect ``none``), each with
``--dp`` ranks and ``--num-pages`` KV pages per rank, behind the real proxy with the KV router.
The workload: ``--groups`` shared prefixes of ``--prefix-tokens`` tokens, each sent
``--rounds`` times with a fresh short suffix, groups interleaved, ``--concurrency`` requests at
a time. Prefill time is proportional to the uncached tokens (``sim_prefill_ms_per_token``).

Two runs on fresh workers, same workload, same router settings:

- rank-aware (``data_parallel_routing: on``): the router places each request on a (backend,
  rank) and sends ``X-data-parallel-rank``;
- rank-blind (``off``, the baseline): one node per backend; the worker picks the rank (least
  loaded, ties round robin), as an engine's own DP balancer does.

Figures per run: prefix hit rate (device prefix-cache hit tokens / prompt tokens, summed over
every rank), mean and p99 request latency (``max_tokens`` 1: time to the first token), and the
ratios rank-aware / rank-blind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from loadtest.dp_workers import RunningWorker, dp_worker
from loadtest.inprocess_server import serving
from pdproxy.app import create_app
from pdproxy.settings import ProxySettings


@dataclass(frozen=True, slots=True)
class RunResult:
    mode: str
    hit_rate: float
    mean_ms: float
    p99_ms: float
    ok: int
    failed: int


def prompts(groups: int, rounds: int, prefix_tokens: int, seed: int) -> list[str]:
    """Each round sends every group once, in a shuffled order (the same for both runs): a
    fixed cycle would let a round-robin rank balancer land each group on the same rank."""
    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        order = list(range(groups))
        rng.shuffle(order)
        for g in order:
            unit = f"[{g:04d}] shared system prompt of group {g}. "
            prefix = (unit * (prefix_tokens // len(unit) + 1))[:prefix_tokens]
            out.append(f"{prefix} question {r} of group {g}?")
    return out


async def run_mode(mode: str, args: argparse.Namespace) -> RunResult:
    async with contextlib.AsyncExitStack() as stack:
        workers: list[RunningWorker] = []
        for i in range(args.workers):
            workers.append(
                await stack.enter_async_context(
                    dp_worker(
                        f"w{i}", "both", args.dp, num_pages=args.num_pages, host_pages=64,
                        sim_prefill_ms_per_token=args.prefill_ms_per_token,
                    )
                )
            )  # fmt: skip
        first = workers[0].settings
        settings = ProxySettings.model_validate(
            {
                "backends": [w.backend("both", dialect="none") for w in workers],
                "router": "kv",
                "router_options": {"model_seed": first.hash_seed, "block_size": first.block_size},
                "health": {"enabled": False},
                "data_parallel_routing": mode,
            }
        )
        url = await stack.enter_async_context(serving(create_app(settings)))
        await asyncio.sleep(0.3)  # event subscriptions join (PUB/SUB)
        latencies: list[float] = []
        failed = 0
        deadline = time.monotonic() + args.time_limit_s
        queue = prompts(args.groups, args.rounds, args.prefix_tokens, args.seed)
        async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:

            async def one(prompt: str) -> None:
                nonlocal failed
                t = time.perf_counter()
                resp = await client.post(
                    "/v1/completions",
                    json={"model": first.model_name, "prompt": prompt, "max_tokens": 1},
                )
                if resp.status_code == 200:
                    latencies.append(time.perf_counter() - t)
                else:
                    failed += 1

            while queue and time.monotonic() < deadline:
                batch, queue = queue[: args.concurrency], queue[args.concurrency :]
                await asyncio.gather(*(one(p) for p in batch))
                await asyncio.sleep(0.05)  # events of this batch reach the router
        ranks = [r for w in workers for r in w.ranks.workers]
        prompt_total = sum(r.stats.prompt_tokens for r in ranks)
        hits = sum(r.stats.prefix_hit_tokens for r in ranks)
        ms = sorted(x * 1e3 for x in latencies) or [0.0]
        return RunResult(
            mode,
            hits / prompt_total if prompt_total else 0.0,
            statistics.fmean(ms),
            ms[min(len(ms) - 1, int(len(ms) * 0.99))],
            len(latencies),
            failed,
        )


async def compare(args: argparse.Namespace) -> tuple[RunResult, RunResult]:
    aware = await run_mode("on", args)
    blind = await run_mode("off", args)
    return aware, blind


def report(aware: RunResult, blind: RunResult, args: argparse.Namespace) -> str:
    lines = [
        f"DP routing: {args.workers} workers x {args.dp} ranks, {args.groups} groups x "
        f"{args.rounds} rounds, {args.prefix_tokens}-token prefixes, {args.num_pages} pages/rank, "
        f"concurrency {args.concurrency}",
        f"  {'mode':<12}{'hit rate':>10}{'mean':>11}{'p99':>11}{'ok':>6}{'failed':>8}",
    ]
    for r, name in ((aware, "rank-aware"), (blind, "rank-blind")):
        lines.append(
            f"  {name:<12}{r.hit_rate:>10.1%}{r.mean_ms:>9.1f}ms{r.p99_ms:>9.1f}ms"
            f"{r.ok:>6}{r.failed:>8}"
        )
    ratio = aware.mean_ms / blind.mean_ms if blind.mean_ms else float("nan")
    lines.append(
        f"  rank-aware / rank-blind: hit rate {aware.hit_rate:.1%} vs {blind.hit_rate:.1%}, "
        f"mean latency x{ratio:.2f}"
    )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--num-pages", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    aware, blind = asyncio.run(compare(args))
    print(report(aware, blind, args), flush=True)


if __name__ == "__main__":
    main()
