"""Routing over workload shapes: pdproxy's KV router with predicted TTFT and without it, round
robin, and vllm-router's ``cache_aware`` on the same sim workers, in the same run.

One benchmark of one shape chose a default once and undid KV routing on another (issue 35), so
the defaults of ``router_options.ttft`` are read off this table. Each shape has a pool of its
own (``sim`` reference workers, NIXL dialect, speeds modelled per worker and never told to the
proxies) and a load of its own:

- ``conversations`` (the shape of issue 35): 4 producers + 4 consumers whose KV is smaller
  than the working set (1,024 device pages, 256 host pages of 16 tokens), no modelled latency
  (``pdproxy up --model sim``'s workers: the cost is the workers' CPU), 24 chats each with its
  own 2,400-character system prompt, 4 turns each, streamed chat, 16-token answers, all started
  within about a second;
- ``families``: 2 + 2, a few system prompts shared by many questions (shared-prefix families);
- ``unique``: 2 + 2, unique prompts, Poisson arrivals;
- ``mixed``: 2 + 2 of different speeds (a producer 3x slower, a consumer decoding 2x slower),
  half shared prefixes, half unique prompts.

Routers (``--routers``): ``ttft`` (pdproxy, KV router, ``ttft.enabled: true``), ``cost`` (the
same with ``enabled: false``: the cost model and its thresholds), ``rr`` (pdproxy's round
robin: every request disaggregated), ``vr-cache`` (vllm-router 0.1.17 ``cache_aware`` in PD
mode, installed into ``--router-venv`` on first use). Every router gets the same schedule on
prompts of its own (no cache left by another), one after the other on the same workers.

A row: requests sent and failed; mean / p50 / p90 TTFT at the client (sent to first token)
and the mean against round robin's in the same shape; ``cached``: the share of prompt tokens
the consumers reported cached (``usage.prompt_tokens_details``: a PD consumer counts the
blocks it fetched, so round robin scores ~1 here); ``computed``: prompt tokens the pool's
engines computed (every worker's admitted prompt tokens minus its prefix hits, from their
``/metrics``) per prompt token sent, the reuse figure (lower is better); ``busiest consumer``:
its share of the requests the consumers finished; ``predicted / deferred``: shares of pdproxy's
decisions the TTFT prediction settled, and where the cost model's choice was kept over it.

    python -m loadtest.bench_shapes [--shapes conversations families unique mixed]
        [--routers ttft cost rr vr-cache] [--scale 1.0] [--guard]

``--guard`` (CI): exits 3 when, on a shape run with both, ``ttft`` failed a request, its pool
computed more of the prompt tokens than ``cost``'s by more than ``--guard-computed``, or its
mean TTFT is over ``--guard-ttft`` times ``cost``'s (a wide margin: a statistic over ~100
requests, not a timing assert).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench_vs_router import add_router_venv_argument, router_binary
from loadtest.ttft_pool import (
    KEYS,
    MODEL,
    Worker,
    WorkerSpec,
    pdproxy_argv,
    proxy,
    proxy_config,
    router_argv,
    wait_ready,
    workers_of,
)
from loadtest.workloads import random_text
from pdproxy.stack.ports import free_port

ROUTERS = ("ttft", "cost", "rr", "vr-cache")


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    pool: tuple[WorkerSpec, ...]
    pages: tuple[int, int]
    sessions: int
    """Conversations, or single requests."""
    rate: float
    """New sessions per second (Poisson)."""
    turns: int = 1
    system_chars: int = 0
    """Each conversation's own system prompt (``conversations``)."""
    groups: int = 0
    """Shared prefixes (``families``, half of ``mixed``)."""
    prefix_chars: int = 0
    question_chars: int = 96
    unique_chars: int = 768
    max_tokens: int = 16


def _pool(
    producers: int, consumers: int, prefill_ms: float, step_ms: float
) -> tuple[WorkerSpec, ...]:
    return tuple(
        [WorkerSpec(f"p{i}", "producer", prefill_ms, step_ms) for i in range(producers)]
        + [WorkerSpec(f"c{i}", "consumer", prefill_ms, step_ms) for i in range(consumers)]
    )


PREFILL_MS, STEP_MS = 0.05, 5.0
"""1x modelled speeds of the other shapes: prefill time per token and decode step (ms)."""

SHAPES = {
    "conversations": Shape("conversations", _pool(4, 4, 0.0, 0.0), (1024, 256),
                           sessions=24, rate=24.0, turns=4, system_chars=2400,
                           question_chars=120),
    "families": Shape("families", _pool(2, 2, PREFILL_MS, STEP_MS), (4096, 4096), sessions=96,
                      rate=8.0, groups=6, prefix_chars=1536),
    "unique": Shape("unique", _pool(2, 2, PREFILL_MS, STEP_MS), (4096, 4096), sessions=96,
                    rate=8.0),
    "mixed": Shape("mixed", (
        WorkerSpec("p0", "producer", PREFILL_MS, STEP_MS),
        WorkerSpec("p1", "producer", 3 * PREFILL_MS, STEP_MS),
        WorkerSpec("c0", "consumer", PREFILL_MS, STEP_MS),
        WorkerSpec("c1", "consumer", PREFILL_MS, 2 * STEP_MS),
    ), (4096, 4096), sessions=96, rate=6.0, groups=4, prefix_chars=1536),
}  # fmt: skip


@dataclass
class Cell:
    ttft_s: list[float] = field(default_factory=list)
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: float = float("nan")
    """Prompt tokens the pool's engines computed (admitted minus prefix hits, every worker)."""
    busiest_share: float = float("nan")
    """The busiest consumer's share of the requests the consumers finished."""
    routes: list[dict[str, Any]] = field(default_factory=list)
    """Each decision's ``x-pdproxy-route`` with the request's TTFT and usage (``--dump``)."""
    decisions: dict[str, int] = field(default_factory=dict)
    """pdproxy's KV decisions by what settled them (``x-pdproxy-route``): ``predicted`` (the
    TTFT prediction's way), ``deferred`` (the cost model's, kept over the prediction's),
    ``cost`` (no prediction: cold, or disabled)."""

    @property
    def computed_share(self) -> float:
        return self.computed_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def sent(self) -> int:
        return len(self.ttft_s) + self.failed

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    def mean_ms(self) -> float:
        return statistics.fmean(self.ttft_s) * 1e3 if self.ttft_s else float("nan")

    def pct_ms(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        s = sorted(self.ttft_s)
        return s[min(int(q * len(s)), len(s) - 1)] * 1e3


def sessions_of(shape: Shape, salt: str, scale: float) -> list[tuple[float, list[str]]]:
    """(start time, the turns' new text) per session: the same times and shapes for every
    ``salt``, text of its own."""
    times = random.Random(f"{shape.name}/times")
    text = random.Random(f"{shape.name}/{salt}")
    prefixes = [random_text(text, shape.prefix_chars) + "\n" for _ in range(shape.groups)]
    out: list[tuple[float, list[str]]] = []
    t = 0.0
    for _ in range(max(1, round(shape.sessions * scale))):
        t += times.expovariate(shape.rate)
        if shape.turns > 1:
            system = random_text(text, shape.system_chars)
            turns = [system] + [random_text(text, shape.question_chars) for _ in range(shape.turns)]
        elif prefixes and times.random() < (0.5 if shape.name == "mixed" else 1.0):
            turns = [times.choice(prefixes) + random_text(text, shape.question_chars)]
        else:
            turns = [random_text(text, shape.unique_chars)]
        out.append((t, turns))
    return out


async def _stream(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], cell: Cell
) -> str | None:
    """One streamed request; the answer's text, or None when it failed."""
    headers = {"authorization": f"Bearer {KEYS['interactive']}", "x-pdproxy-debug": "1"}
    t0 = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                cell.failed += 1
                return None
            route = resp.headers.get("x-pdproxy-route")
            _count_decision(route, cell)
            async for line in resp.content:
                if not line.startswith(b"data:") or b"[DONE]" in line:
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if piece:
                        first = first if first is not None else time.perf_counter() - t0
                        parts.append(piece)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        cell.failed += 1
        return None
    if first is None:
        cell.failed += 1
        return None
    cell.ttft_s.append(first)
    if route and route.startswith("{"):
        cell.routes.append({"ttft_ms": first * 1e3, "usage": usage, "route": json.loads(route)})
    cell.prompt_tokens += int(usage.get("prompt_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cell.cached_tokens += int(details.get("cached_tokens") or 0)
    return "".join(parts)


def _count_decision(route: str | None, cell: Cell) -> None:
    if not route:
        return
    ttft = json.loads(route).get("ttft") if route.startswith("{") else None
    kind = "cost" if not ttft else "deferred" if ttft.get("deferred") else "predicted"
    cell.decisions[kind] = cell.decisions.get(kind, 0) + 1


async def _session(
    session: aiohttp.ClientSession, url: str, shape: Shape, turns: list[str], cell: Cell
) -> None:
    common = {"model": MODEL, "max_tokens": shape.max_tokens, "temperature": 0.0,
              "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if shape.turns == 1:
        await _stream(session, url, "/v1/completions", {**common, "prompt": turns[0]}, cell)
        return
    messages = [{"role": "system", "content": turns[0]}]
    for question in turns[1:]:
        messages.append({"role": "user", "content": question})
        body = {**common, "messages": list(messages)}
        answer = await _stream(session, url, "/v1/chat/completions", body, cell)
        messages.append({"role": "assistant", "content": answer or ""})


_COUNTERS = ("prompt_tokens", "prefix_hit_tokens", "finished_requests")


async def _counters(
    session: aiohttp.ClientSession, workers: list[Worker]
) -> dict[str, dict[str, float]]:
    """Each worker's engine counters (its /metrics)."""
    out: dict[str, dict[str, float]] = {}
    for w in workers:
        async with session.get(w.url + "/metrics") as resp:
            text = await resp.text()
        values = {}
        for line in text.splitlines():
            for name in _COUNTERS:
                if line.startswith(f"kvtier_worker_{name}_total "):
                    values[name] = float(line.split()[1])
        out[w.spec.name] = values
    return out


async def run_cell(
    url: str, schedule: list[tuple[float, list[str]]], shape: Shape, workers: list[Worker]
) -> Cell:
    cell = Cell()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        before = await _counters(session, workers)
        start = time.perf_counter()
        tasks = []
        for at, turns in schedule:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_session(session, url, shape, turns, cell)))
        await asyncio.gather(*tasks)
        after = await _counters(session, workers)

    def delta(node: str, name: str) -> float:
        return after[node].get(name, 0.0) - before[node].get(name, 0.0)

    cell.computed_tokens = sum(
        delta(n, "prompt_tokens") - delta(n, "prefix_hit_tokens") for n in after
    )
    finished = [
        delta(w.spec.name, "finished_requests") for w in workers if w.spec.role == "consumer"
    ]
    if sum(finished) > 0:
        cell.busiest_share = max(finished) / sum(finished)
    return cell


def _router_config(name: str, workers: list[Worker], port: int) -> dict[str, Any]:
    config = proxy_config(workers, port, {"enabled": name != "cost"})
    for key in config["api_keys"]:
        key["see_cached_tokens"] = True  # the benchmark reads reuse from the answers
    if name == "rr":
        config["router"] = "round_robin"
    return config


async def bench_shape(
    shape: Shape, routers: Sequence[str], args: argparse.Namespace, tmp: Path
) -> dict[str, Cell]:
    cells: dict[str, Cell] = {}
    with workers_of(shape.pool, tmp / shape.name, shape.pages) as workers:
        for w in workers:
            await wait_ready(w.url + "/health")
        for name in routers:
            with contextlib.ExitStack() as stack:
                port = free_port()
                if name == "vr-cache":
                    binary = router_binary(args.router_venv.resolve())
                    argv, health = router_argv(binary, port, workers, "cache_aware"), "/health"
                else:
                    argv = pdproxy_argv(_router_config(name, workers, port), tmp, name)
                    health = "/ready"
                url, proc = stack.enter_context(proxy(f"{shape.name}-{name}", argv, tmp))
                await wait_ready(url + health, proc)
                await asyncio.sleep(2.0)  # health checks admit every backend
                schedule = sessions_of(shape, name, args.scale)
                cells[name] = await run_cell(url, schedule, shape, workers)
            if args.dump is not None:
                with args.dump.open("a") as f:
                    for row in cells[name].routes:
                        f.write(json.dumps({"shape": shape.name, "router": name, **row}) + "\n")
            _print_row(shape.name, name, cells[name], cells.get("rr"))
            await asyncio.sleep(args.settle)
    return cells


def _print_row(shape: str, name: str, c: Cell, rr: Cell | None) -> None:
    vs = f"x{c.mean_ms() / rr.mean_ms():.2f}" if rr is not None and rr.ttft_s else "-"
    print(f"| {shape} | {name} | {c.sent} | {c.failed} | {c.mean_ms():.0f} | "
          f"{c.pct_ms(0.5):.0f} | {c.pct_ms(0.9):.0f} | {vs} | {c.cached_share:.2f} | "
          f"{c.computed_share:.2f} | {c.busiest_share:.2f} | {_settled(c)} |",
          flush=True)  # fmt: skip


def _settled(c: Cell) -> str:
    """Shares of the decisions the prediction settled and the cost model kept over it."""
    n = sum(c.decisions.values())
    if not n or set(c.decisions) == {"cost"}:
        return "-"
    return f"{c.decisions.get('predicted', 0) / n:.2f} / {c.decisions.get('deferred', 0) / n:.2f}"


def guard(results: dict[str, dict[str, Cell]], computed_margin: float, ttft_x: float) -> list[str]:
    """What fails the guard: on a shape run with both, ``ttft`` behind ``cost``."""
    failures = []
    for shape, cells in results.items():
        on, off = cells.get("ttft"), cells.get("cost")
        if on is None or off is None:
            continue
        if on.failed or off.failed:
            failures.append(f"{shape}: failed requests (ttft {on.failed}, cost {off.failed})")
        # Reuse is what the pool computed, not what consumers report cached: a PD consumer
        # counts the blocks it fetched, so the reported share falls when more requests are
        # served alone though the pool computes no more (0.81 against 0.92, computed 0.31
        # against 0.32, in one run here).
        if on.computed_share > off.computed_share + computed_margin:
            failures.append(f"{shape}: ttft computed {on.computed_share:.2f} > cost "
                            f"{off.computed_share:.2f} + {computed_margin}")  # fmt: skip
        if not math.isfinite(on.mean_ms()) or on.mean_ms() > ttft_x * off.mean_ms():
            failures.append(f"{shape}: ttft mean {on.mean_ms():.0f} ms > {ttft_x} x cost "
                            f"{off.mean_ms():.0f} ms")  # fmt: skip
    return failures


async def bench(args: argparse.Namespace) -> int:
    results: dict[str, dict[str, Cell]] = {}
    # Round robin first in each shape, so every row can be read against it.
    routers = sorted(args.routers, key=lambda r: r != "rr")
    with tempfile.TemporaryDirectory(prefix="bench-shapes-") as tmp_name:
        tmp = Path(tmp_name)
        for name in args.shapes:
            (tmp / name).mkdir()
            results[name] = await bench_shape(SHAPES[name], routers, args, tmp)
    if not args.guard:
        return 0
    failures = guard(results, args.guard_computed, args.guard_ttft)
    for f in failures:
        print(f"guard: {f}")
    print("guard: ok" if not failures else "guard: FAILED", flush=True)
    return 3 if failures else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    p.add_argument("--scale", type=float, default=1.0, help="sessions per shape, x")
    p.add_argument("--settle", type=float, default=2.0, help="idle seconds between cells")
    p.add_argument("--dump", type=Path, help="append pdproxy's decisions here (JSON lines)")
    p.add_argument("--guard", action="store_true")
    p.add_argument("--guard-computed", type=float, default=0.10)
    p.add_argument("--guard-ttft", type=float, default=2.0)
    add_router_venv_argument(p)
    args = p.parse_args(argv)
    print("| shape | router | sent | failed | mean ms | p50 ms | p90 ms | mean vs rr | cached "
          "| computed | busiest consumer | predicted / deferred |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    sys.exit(asyncio.run(bench(args)))


if __name__ == "__main__":
    main()
