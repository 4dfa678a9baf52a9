"""SLO attainment on a mixed-speed pool: pdproxy with predicted TTFT, without it, vllm-router.

The pool: ``sim`` reference workers with per-node speeds (``--sim-prefill-ms-per-token``,
``--sim-decode-ms-per-step`` per worker, nothing told to the proxies): producer ``p0`` at 1x
prefill time and ``p1`` at 3x (a noisy neighbour), consumers ``c0`` at 1x decode step and ``c1``
at 2x. Every proxy fronts the same four workers (NIXL dialect) in the same run:

- ``ttft``: pdproxy, KV router, predicted TTFT on (``router_options.ttft``), classes per key;
- ``cost``: the same pdproxy config with ``ttft.enabled: false`` (the cost model, thresholds);
- ``vr-cache``/``vr-p2``: vllm-router 0.1.17 in PD mode, ``cache_aware`` and ``power_of_two``
  (installed into ``.venv-router`` as :mod:`loadtest.bench_vs_router` does).

The load: Poisson arrivals at each ``--rates`` value (req/s, ramped past the pool's capacity),
``--seconds`` per cell; ``--batch-share`` of them batch requests (a long unique prompt, key
``batch``), the rest interactive (key ``interactive``): half a shared system prompt of one of
``--groups`` groups plus a unique question, half a unique prompt. Every proxy gets the same
schedule; each cell uses prefixes of its own, so no proxy inherits another's warm cache.
Streamed; TTFT is measured at the client (request sent to first token).

The interactive target is ``--target-x`` times the quiet median TTFT, measured first on ``cost``
at a trickle; batch's is ``--batch-target-x`` times that. A cell reports the interactive SLO
attainment (share within target; a refused one missed), goodput (requests per second within
their class's target), batch refused, p50/p90 TTFT, and for ``ttft`` the prediction error
p50 (|predicted - observed| / observed, from the ``x-pdproxy-route`` header; warm: after the
first cell).

    python -m loadtest.bench_ttft [--rates 2 4 6] [--seconds 15]
        [--proxies ttft cost vr-cache vr-p2] [--dump FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtest.bench_vs_router import add_router_venv_argument, router_binary
from loadtest.ttft_pool import (
    KEYS,
    MODEL,
    cluster,
    pdproxy_argv,
    proxy,
    proxy_config,
    router_argv,
    ttft_options,
    wait_ready,
)
from pdproxy.stack.ports import free_port


@dataclass(frozen=True, slots=True)
class Arrival:
    at: float
    kind: str
    prompt: str
    max_tokens: int


@dataclass
class Cell:
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"interactive": [], "batch": []})
    refused: dict[str, int] = field(default_factory=lambda: {"interactive": 0, "batch": 0})
    failed: int = 0
    sent: dict[str, int] = field(default_factory=lambda: {"interactive": 0, "batch": 0})
    errors: list[float] = field(default_factory=list)
    seconds: float = 0.0
    routes: list[tuple[str, float, str]] = field(default_factory=list)
    """(kind, observed TTFT, x-pdproxy-route) per served request (``--dump``)."""

    def attainment(self, target_s: float) -> float:
        n = self.sent["interactive"]
        return sum(t <= target_s for t in self.ttft["interactive"]) / n if n else float("nan")

    def goodput(self, targets: dict[str, float]) -> float:
        good = sum(sum(t <= targets[k] for t in v) for k, v in self.ttft.items())
        return good / self.seconds if self.seconds else 0.0


def _text(seed: str, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(n))


def schedule(
    rate: float, seconds: float, cell: int, args: argparse.Namespace, salt: str = ""
) -> list[Arrival]:
    """The cell's arrivals (times, kinds, shapes fixed by ``cell``); ``salt`` changes only the
    prompts' text, so each proxy gets the same load on prefixes of its own."""
    rng = random.Random(f"{args.seed}/{cell}/{rate}")
    cell_salt = f"{cell}/{salt}"
    prefixes = [_text(f"prefix/{cell_salt}/{g}", args.prefix_tokens) for g in range(args.groups)]
    out: list[Arrival] = []
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        i += 1
        if rng.random() < args.batch_share:
            prompt = _text(f"batch/{cell_salt}/{i}", args.batch_tokens)
            out.append(Arrival(t, "batch", prompt, args.batch_max_tokens))
        elif rng.random() < 0.5:
            prompt = rng.choice(prefixes) + _text(f"q/{cell_salt}/{i}", args.question_tokens)
            out.append(Arrival(t, "interactive", prompt, args.max_tokens))
        else:
            prompt = _text(f"u/{cell_salt}/{i}", args.unique_tokens)
            out.append(Arrival(t, "interactive", prompt, args.max_tokens))


async def one(
    session: aiohttp.ClientSession, url: str, a: Arrival, cell: Cell, debug: bool
) -> None:
    body = {"model": MODEL, "prompt": a.prompt, "max_tokens": a.max_tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"authorization": f"Bearer {KEYS[a.kind]}", "content-type": "application/json"}
    if debug:
        headers["x-pdproxy-debug"] = "1"
    cell.sent[a.kind] += 1
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
            if resp.status == 429:
                cell.refused[a.kind] += 1
                await resp.read()
                return
            if resp.status != 200:
                cell.failed += 1
                await resp.read()
                return
            first = None
            async for line in resp.content:
                if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                    first = time.perf_counter() - t0
            if first is None:
                cell.failed += 1
                return
            cell.ttft[a.kind].append(first)
            route = resp.headers.get("x-pdproxy-route")
            if route:
                cell.routes.append((a.kind, first, route))
            predicted = _predicted_ms(route)
            if predicted is not None:
                cell.errors.append(abs(predicted / 1e3 - first) / first)
    except (aiohttp.ClientError, TimeoutError):
        cell.failed += 1


def _predicted_ms(header: str | None) -> float | None:
    if not header:
        return None
    with contextlib.suppress(ValueError, KeyError, TypeError):
        chosen = json.loads(header)["ttft"]["chosen"]
        return float(chosen["ms"])
    return None


async def run_cell(url: str, arrivals: list[Arrival], seconds: float, debug: bool) -> Cell:
    cell = Cell(seconds=seconds)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        tasks = []
        for a in arrivals:
            delay = start + a.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, url, a, cell, debug)))
        await asyncio.gather(*tasks)
    return cell


async def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp_name:
        tmp = Path(tmp_name)
        with cluster(args, tmp) as workers, contextlib.ExitStack() as stack:
            for w in workers:
                await wait_ready(w.url + "/health")
            urls: dict[str, str] = {}
            binary = router_binary(args.router_venv.resolve()) if any(
                p.startswith("vr-") for p in args.proxies
            ) else None  # fmt: skip
            # The quiet median first, on the cost model at a trickle: it sets the targets.
            cost_cfg = proxy_config(workers, free_port(), ttft_options(False, 1e6, 1e6))
            cost, proc = stack.enter_context(
                proxy("quiet", pdproxy_argv(cost_cfg, tmp, "quiet"), tmp)
            )
            await wait_ready(cost + "/ready", proc)
            await asyncio.sleep(2.0)  # health checks admit every backend
            quiet = await run_cell(cost, schedule(args.quiet_rate, args.quiet_seconds, 999,
                                                  args), args.quiet_seconds, False)  # fmt: skip
            samples = quiet.ttft["interactive"]
            if not samples:
                raise RuntimeError(f"the quiet run served nothing ({quiet.failed} failed)")
            quiet_ms = statistics.median(samples) * 1e3
            target_ms = args.target_x * quiet_ms
            batch_ms = args.batch_target_x * quiet_ms
            print(f"quiet median TTFT {quiet_ms:.0f} ms ({len(samples)} requests): interactive "
                  f"target {target_ms:.0f} ms, batch {batch_ms:.0f} ms", flush=True)  # fmt: skip
            for name in args.proxies:
                port = free_port()
                if name in ("ttft", "cost"):
                    cfg = proxy_config(
                        workers, port, ttft_options(name == "ttft", target_ms, batch_ms)
                    )
                    argv = pdproxy_argv(cfg, tmp, name)
                    health = "/ready"
                else:
                    assert binary is not None
                    policy = {"vr-cache": "cache_aware", "vr-p2": "power_of_two"}[name]
                    argv = router_argv(binary, port, workers, policy)
                    health = "/health"
                urls[name], proc = stack.enter_context(proxy(name, argv, tmp))
                await wait_ready(urls[name] + health, proc)
            await asyncio.sleep(2.0)
            targets = {"interactive": target_ms / 1e3, "batch": batch_ms / 1e3}
            results: dict[tuple[float, str], Cell] = {}
            for ci, rate in enumerate(args.rates):
                for name in args.proxies:
                    # Each proxy its own prefixes: the same load, no cache left by another.
                    own = schedule(rate, args.seconds, ci, args, salt=name)
                    cell = await run_cell(urls[name], own, args.seconds, name == "ttft")
                    results[(rate, name)] = cell
                    if args.dump is not None:
                        with args.dump.open("a") as f:
                            for kind, first, route in cell.routes:
                                row = {"rate": rate, "kind": kind, "ms": first * 1e3}
                                f.write(json.dumps({**row, "route": json.loads(route)}) + "\n")
                    _print_row(rate, name, cell, targets, warm=ci > 0)
                    await asyncio.sleep(args.settle)
            _summary(args, results, targets)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def _print_row(rate: float, name: str, c: Cell, targets: dict[str, float], *, warm: bool) -> None:
    inter = c.ttft["interactive"]
    err = f"{statistics.median(c.errors) * 100:5.1f}%" if c.errors and warm else "    -"
    print(f"| {rate:4.1f} | {name:<8} | {c.attainment(targets['interactive']) * 100:5.1f}% | "
          f"{c.goodput(targets):5.2f} | {_pct(inter, 0.5) * 1e3:6.0f} | "
          f"{_pct(inter, 0.9) * 1e3:6.0f} | {c.refused['batch']:3d}/{c.sent['batch']:<3d} | "
          f"{c.refused['interactive']:3d} | {c.failed:3d} | {err} |", flush=True)  # fmt: skip


def _summary(
    args: argparse.Namespace, results: dict[tuple[float, str], Cell], targets: dict[str, float]
) -> None:
    peers = [p for p in args.proxies if p != "ttft"]
    if "ttft" not in args.proxies or not peers:
        return
    print("\nttft vs the best peer at each load (interactive SLO attainment):")
    for rate in args.rates:
        ours = results[(rate, "ttft")].attainment(targets["interactive"])
        best = max(peers, key=lambda p: results[(rate, p)].attainment(targets["interactive"]))
        theirs = results[(rate, best)].attainment(targets["interactive"])
        ratio = ours / theirs if theirs else float("inf")
        print(f"  {rate:4.1f} req/s: ttft {ours * 100:5.1f}% vs {best} {theirs * 100:5.1f}% "
              f"-> x{ratio:.2f}")  # fmt: skip
    print("ttft vs each peer at the first load where that peer falls below 80%:")
    for peer in peers:
        below = [
            r for r in args.rates if results[(r, peer)].attainment(targets["interactive"]) < 0.8
        ]
        if not below:
            print(f"  {peer}: never below 80%")
            continue
        r = below[0]
        ours = results[(r, "ttft")].attainment(targets["interactive"])
        theirs = results[(r, peer)].attainment(targets["interactive"])
        ratio = ours / theirs if theirs else float("inf")
        print(
            f"  {peer} at {r:.1f} req/s: {theirs * 100:.1f}% -> ttft {ours * 100:.1f}% x{ratio:.2f}"
        )
    warm = [e for (rate, name), c in results.items() if name == "ttft" and rate != args.rates[0]
            for e in c.errors]  # fmt: skip
    if warm:
        print(f"prediction error p50 (warm cells): {statistics.median(warm) * 100:.1f}%")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 3.0, 4.0])
    p.add_argument("--seconds", type=float, default=20.0, help="arrivals per cell")
    p.add_argument("--settle", type=float, default=2.0, help="idle seconds between cells")
    p.add_argument("--proxies", nargs="+", default=["ttft", "cost", "vr-cache", "vr-p2"])
    p.add_argument("--prefill-ms", type=float, default=0.25, help="1x prefill ms per token")
    p.add_argument("--step-ms", type=float, default=10.0, help="1x decode step ms")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix-tokens", type=int, default=1536)
    p.add_argument("--question-tokens", type=int, default=96)
    p.add_argument("--unique-tokens", type=int, default=768)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--batch-share", type=float, default=0.3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--batch-max-tokens", type=int, default=32)
    p.add_argument("--target-x", type=float, default=3.0, help="interactive target / quiet p50")
    p.add_argument("--batch-target-x", type=float, default=15.0)
    p.add_argument("--quiet-rate", type=float, default=0.5)
    p.add_argument("--quiet-seconds", type=float, default=12.0)
    p.add_argument("--seed", default="bench-ttft")
    p.add_argument("--dump", type=Path, help="append ttft's routes and TTFTs here (JSON lines)")
    add_router_venv_argument(p)
    args = p.parse_args(argv)
    print("| req/s | proxy | SLO met | goodput/s | p50 ms | p90 ms | batch shed | inter shed "
          "| failed | err p50 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
