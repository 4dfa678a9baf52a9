"""Benchmark of the router's two outside signals, each against the same router with the
feature off, in the same run (prints; asserts nothing).

    python -m loadtest.bench_signals [--load] [--exactness] [--seed 1]

Both scenarios run the real KV router (``build_kv_router``) over in-process simulated engines
(:mod:`loadtest.signal_sim`: slots, a waiting queue, an LRU prefix cache, prefill time per
uncached token) that publish real KV events over ZMQ and serve a real ``/metrics`` page; the
router's own scraper and event feeds read them. Requests arrive as a Poisson process over a
shared-prefix workload (``--groups`` Zipf-popular prefixes of ``--prefix-tokens`` plus a
unique suffix).

1. ``--load``: 2 engines; another client keeps ``--external`` long requests on c0 directly
   (not through this router), so c0's slots are full and its queue is long. Mean and p99 TTFT
   of the router's requests with engine-load scraping on vs off.
2. ``--exactness``: 4 engines whose caches are smaller than the working set; after a warm-up,
   c0's KV events are dropped (it goes on serving and evicting, the router hears nothing).
   Wrong-route rate (the router predicted more cached tokens on the chosen engine than the
   engine found, by at least one block) and mean TTFT with index exactness on vs off.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvtier.keys import BlockHasher
from loadtest.signal_sim import SimEngine
from pdproxy.routing.base import RequestOutcome, Role, RouteRequest
from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.router import KvRouter
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import EngineLoadSettings, IndexExactnessSettings

SEED = "bench-signals"
BS = 16


@dataclass
class _Backend:
    name: str
    url: str = ""
    role: Role = Role.CONSUMER
    routable: bool = True
    in_flight: int = 0
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    events_listen: bool = False


class _Registry:
    def __init__(self, backends: list[_Backend]) -> None:
        self.backends = backends

    def all(self) -> list[_Backend]:
        return list(self.backends)


@dataclass
class _Tally:
    ttft_s: list[float] = field(default_factory=list)
    wrong: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    to_c0: int = 0
    wrong_c0: int = 0

    def row(self, label: str, base: _Tally | None) -> str:
        n = len(self.ttft_s) or 1
        mean = statistics.fmean(self.ttft_s) * 1e3 if self.ttft_s else 0.0
        p99 = sorted(self.ttft_s)[min(len(self.ttft_s) - 1, int(0.99 * n))] * 1e3
        ratio = ""
        if base is not None and base.ttft_s:
            ratio = f"{mean / (statistics.fmean(base.ttft_s) * 1e3):8.2f}x"
        return (
            f"  {label:<16}{len(self.ttft_s):>6}{mean:>11.1f}ms{p99:>11.1f}ms"
            f"{self.wrong / n:>10.1%}{self.cached_tokens / max(self.prompt_tokens, 1):>9.1%}"
            f"{self.to_c0 / n:>8.1%}{self.wrong_c0 / max(self.to_c0, 1):>11.1%}{ratio:>10}"
        )


HEADER = (
    f"  {'router':<16}{'reqs':>6}{'mean TTFT':>13}{'p99 TTFT':>13}{'wrong':>10}{'hit':>9}"
    f"{'to c0':>8}{'wrong c0':>11}{'vs off':>10}"
)


def _prompts(args: argparse.Namespace, rng: random.Random, n: int) -> list[str]:
    out = []
    weights = [1.0 / (g + 1) ** args.zipf for g in range(args.groups)]
    for _ in range(n):
        g = rng.choices(range(args.groups), weights)[0]
        unit = f"[{g:04d}] shared system prompt of this group. "
        prefix = (unit * (args.prefix_tokens // len(unit) + 1))[: args.prefix_tokens]
        suffix = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(args.suffix))
        out.append(prefix + suffix)
    return out


async def _drive(
    router: KvRouter,
    engines: dict[str, SimEngine],
    backends: list[_Backend],
    prompts: list[str],
    *,
    rate: float,
    rng: random.Random,
    tally: _Tally | None,
) -> None:
    hasher = BlockHasher(SEED, BS)

    async def one(text: str) -> None:
        tokens = list(text.encode())
        hashes = hasher.hash_tokens(tokens)
        req = RouteRequest(uuid.uuid4().hex, "completions", {"model": "m", "prompt": text})
        decision = await router.route(req, [], backends)
        name = decision.consumers[0].name
        served = await engines[name].serve(tokens, hashes)
        await router.finished(decision, RequestOutcome(None, name, True, served.cached_tokens))
        if tally is None:
            return
        tally.ttft_s.append(served.ttft_s)
        tally.prompt_tokens += len(tokens)
        tally.cached_tokens += served.cached_tokens
        tally.to_c0 += name == "c0"
        predicted = decision.predicted_cached_tokens or 0
        if predicted >= served.cached_tokens + BS:
            tally.wrong += 1
            tally.wrong_c0 += name == "c0"

    tasks = []
    for text in prompts:
        tasks.append(asyncio.create_task(one(text)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


def _engines(n: int, args: argparse.Namespace, capacity: int) -> dict[str, SimEngine]:
    return {
        f"c{i}": SimEngine(
            f"c{i}",
            slots=args.slots,
            capacity_blocks=capacity,
            block_size=BS,
            prefill_s_per_token=args.prefill_us_per_token * 1e-6,
            decode_s=args.decode_ms * 1e-3,
        )
        for i in range(n)
    }


async def _load_variant(args: argparse.Namespace, enabled: bool) -> _Tally:
    engines = _engines(2, args, capacity=100_000)
    backends = [_Backend(name, await e.start_metrics()) for name, e in engines.items()]
    settings = KvRouterSettings(
        model_seed=SEED,
        block_size=BS,
        engine_load=EngineLoadSettings(enabled=enabled, interval_s=args.scrape_interval_s),
    )
    router = build_kv_router(
        settings, backends=_Registry(backends), metrics_registry=CollectorRegistry()
    )
    await router.start()
    rng = random.Random(args.seed)
    stop = asyncio.Event()
    busy = engines["c0"]

    async def other_client() -> None:
        """Keeps c0 busy directly (not through the router): long decodes, unique prompts."""
        hasher = BlockHasher("other-client", BS)
        while not stop.is_set():
            tokens = [rng.randrange(256) for _ in range(64)]
            await busy.serve(tokens, hasher.hash_tokens(tokens), decode_s=args.external_decode_s)

    others = [asyncio.create_task(other_client()) for _ in range(args.external)]
    try:
        await asyncio.sleep(max(args.scrape_interval_s * 2, 0.5))  # the queue builds up
        tally = _Tally()
        prompts = _prompts(args, rng, args.requests)
        await _drive(router, engines, backends, prompts, rate=args.rate, rng=rng, tally=tally)
        return tally
    finally:
        stop.set()
        await asyncio.gather(*others, return_exceptions=True)
        await router.close()
        for e in engines.values():
            await e.close()


async def _exactness_variant(
    args: argparse.Namespace, enabled: bool, stale_credit: float = 0.0
) -> _Tally:
    engines = _engines(4, args, capacity=args.capacity_blocks)
    events = {name: await e.start_events() for name, e in engines.items()}
    settings = KvRouterSettings(
        model_seed=SEED,
        block_size=BS,
        events={n: ep for n, (ep, _) in events.items()},
        replay={n: rp for n, (_, rp) in events.items()},
        index_exactness=IndexExactnessSettings(
            enabled=enabled, silence_s=args.silence_s, stale_credit=stale_credit
        ),
    )
    router = build_kv_router(settings, metrics_registry=CollectorRegistry())
    await router.start()
    backends = [_Backend(name) for name in engines]
    rng = random.Random(args.seed)
    try:
        await asyncio.sleep(0.3)  # subscriptions connect
        warm = _prompts(args, rng, args.warmup)
        await _drive(router, engines, backends, warm, rate=args.rate, rng=rng, tally=None)
        engines["c0"].events_dropped = True
        tally = _Tally()
        prompts = _prompts(args, rng, args.requests)
        await _drive(router, engines, backends, prompts, rate=args.rate, rng=rng, tally=tally)
        return tally
    finally:
        await router.close()
        for e in engines.values():
            await e.close()


async def _main(args: argparse.Namespace) -> None:
    both = not (args.load or args.exactness)
    if args.load or both:
        print(
            f"\nEngine-reported load: 2 engines x {args.slots} slots; another client keeps "
            f"{args.external} requests ({args.external_decode_s:g} s decode) on c0 directly; "
            f"{args.requests} requests at {args.rate:g}/s through the router; scrape every "
            f"{args.scrape_interval_s:g} s"
        )
        off = await _load_variant(args, enabled=False)
        on = await _load_variant(args, enabled=True)
        print(HEADER)
        print(off.row("scrape off", None))
        print(on.row("scrape on", off))
    if args.exactness or both:
        print(
            f"\nIndex exactness: 4 engines x {args.capacity_blocks} blocks, {args.groups} groups "
            f"of {args.prefix_tokens} tokens; c0's events dropped after {args.warmup} requests; "
            f"{args.requests} requests at {args.rate:g}/s; silence_s={args.silence_s:g}"
        )
        off = await _exactness_variant(args, enabled=False)
        rows = [
            (credit, await _exactness_variant(args, enabled=True, stale_credit=credit))
            for credit in args.stale_credit or [0.0]
        ]
        print(HEADER)
        print(off.row("exactness off", None))
        for credit, on in rows:
            print(on.row(f"on, stale {credit:g}", off))
        print(
            "  wrong: predicted cached tokens on the chosen engine >= found + one block; "
            "wrong c0: share of the requests sent to c0"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--load", action="store_true", help="only the engine-load scenario")
    parser.add_argument("--exactness", action="store_true", help="only the exactness scenario")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--zipf", type=float, default=0.8, help="group popularity skew")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--prefill-us-per-token", type=float, default=20.0)
    parser.add_argument("--decode-ms", type=float, default=40.0)
    parser.add_argument("--capacity-blocks", type=int, default=256)
    parser.add_argument("--external", type=int, default=12)
    parser.add_argument("--external-decode-s", type=float, default=0.5)
    parser.add_argument("--scrape-interval-s", type=float, default=0.25)
    parser.add_argument("--silence-s", type=float, default=0.5)
    parser.add_argument(
        "--stale-credit",
        type=float,
        action="append",
        default=[],
        help="index_exactness.stale_credit of an 'on' row (repeatable; default 0)",
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    asyncio.run(_main(args))
    print(f"\n  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
