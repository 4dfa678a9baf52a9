"""Benchmark: routing quality with 1, 2 and 4 proxy replicas sharing one Redis (prints; asserts
nothing).

    python -m loadtest.bench_replicas [--replicas 1 2 4] [--groups 16] [--per-group 8]
        [--rate 4] [--rounds 2] [--time-limit-s 60] [--redis-url URL]

For each replica count, on a fresh Redis (a redis-server this benchmark starts, flushed
between runs, or ``--redis-url``, which is then flushed too: give it a throwaway server): the
local stack (``pdproxy.stack``: 2 producer + 2 consumer ``sim`` workers, prefill time
proportional to uncached tokens, and one proxy with the KV router on Redis), plus N-1 more
``pdproxy serve`` replicas on the stack's own config. Every replica follows the workers' event
streams (one of them writes each stream, under a lease) and shares residency, predictions and
load through Redis. The client sends the shared-prefix workload (``--groups`` x ``--per-group``
prompts sharing a ``--system-tokens`` system prompt, Poisson at ``--rate``) to the replicas in
turn, so a group's prompts reach every replica.

Printed per replica count: mean and p99 TTFT, prefix hit rate
(:mod:`loadtest.prefix_workload`: 1 - tokens the workers computed / prompt tokens sent, over
both legs), requests ok/failed, and mean TTFT and hit rate relative to one replica (the
baseline, measured in the same run), averaged over ``--rounds`` runs whose order alternates
(1, 2, 4, then 4, 2, 1), so load drift on a shared machine hits every count alike. Routing
quality holds when the ratios stay near 1. Each run is bounded by ``--time-limit-s``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import redis

from loadtest import prefix_workload
from loadtest.local_stack import local_stack
from loadtest.prefix_workload import QualityRow
from loadtest.redis_server import own_redis_server
from pdproxy.stack.ports import free_port


@contextlib.contextmanager
def _replica(config: Path, log: Path) -> Iterator[str]:
    """One more ``pdproxy serve`` (one process) on ``config``; yields its URL once ready and
    stops it by its PID (SIGTERM, then SIGKILL) on the way out."""
    port = free_port()
    argv = [
        sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(config),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"replica did not start:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def _run(args: argparse.Namespace, replicas: int, redis_url: str) -> QualityRow:
    redis.Redis.from_url(redis_url).flushall()
    stack_args = prefix_workload.stack_args(
        args, "kv", "--redis", redis_url, "--proxy-arg=--workers", "--proxy-arg=1"
    )
    with local_stack(stack_args) as stack, contextlib.ExitStack() as more:
        run_dir = stack.log_path.parent / "run"
        extra = tuple(
            more.enter_context(_replica(run_dir / "proxy.yaml", run_dir / f"replica-{i}.log"))
            for i in range(1, replicas)
        )
        time.sleep(args.settle_s)  # every replica subscribed; leases taken
        return prefix_workload.run(args, stack, extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--redis-url", default=None, help="a throwaway server: it is flushed")
    prefix_workload.add_arguments(
        parser, groups=16, per_group=8, rate=4.0, time_limit_s=60, time_limit_help="per run"
    )
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait before sending")
    parser.add_argument("--rounds", type=int, default=2, help="runs per replica count")
    args = parser.parse_args()
    print(
        f"Proxy replicas sharing one Redis: {prefix_workload.describe(args)}; requests spread "
        "over the replicas in turn",
        flush=True,
    )
    runs: dict[int, list[QualityRow]] = {n: [] for n in args.replicas}
    with contextlib.ExitStack() as stack:
        url = args.redis_url or stack.enter_context(own_redis_server())
        for r in range(args.rounds):
            order = args.replicas if r % 2 == 0 else list(reversed(args.replicas))
            for n in order:
                row = _run(args, n, url)
                runs[n].append(row)
                print(
                    f"  round {r + 1}: {n} replica(s): mean TTFT {row.mean_ttft_ms:.1f} ms, "
                    f"hit rate {row.hit_rate:.1%}",
                    flush=True,
                )
    rows = {n: _pooled(runs[n]) for n in args.replicas}
    base_n = args.replicas[0]
    base = rows[base_n]
    print(
        f"  {'replicas':<10}{'mean TTFT':>12}{'p99 TTFT':>12}{'hit rate':>10}{'ok':>6}"
        f"{'failed':>8}{'mean/base':>11}{'hit/base':>10}"
    )
    for n, row in rows.items():
        print(
            f"  {n:<10}{row.mean_ttft_ms:>10.1f}ms{row.p99_ttft_ms:>10.1f}ms"
            f"{row.hit_rate:>10.1%}{row.ok:>6}{row.failed:>8}"
            f"{row.mean_ttft_ms / (base.mean_ttft_ms or 1e-9):>10.2f}x"
            f"{row.hit_rate / (base.hit_rate or 1e-9):>9.2f}x"
        )
    print(
        f"  base: {base_n} replica(s), same run; {args.rounds} round(s), order "
        "alternating, TTFT/hit rate averaged over rounds; quality holds when ratios stay ~1"
    )


def _pooled(rows: Sequence[QualityRow]) -> QualityRow:
    n = len(rows)
    return QualityRow(
        sum(r.mean_ttft_ms for r in rows) / n,
        sum(r.p99_ttft_ms for r in rows) / n,
        sum(r.hit_rate for r in rows) / n,
        sum(r.ok for r in rows),
        sum(r.failed for r in rows),
    )


if __name__ == "__main__":
    main()
