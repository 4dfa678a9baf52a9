"""Routing quality on sim workers: the shared-prefix workload and what it measures.

Used by :mod:`loadtest.bench_router` (KV-aware vs round-robin vs least-loaded) and
:mod:`loadtest.bench_replicas` (1, 2, 4 proxy replicas on one Redis): the same flags, the same
local stack (``pdproxy.stack``: 2 producer + 2 consumer ``sim`` workers, prefill time
proportional to uncached tokens) and the same row per run:

- mean and p99 TTFT, requests ok and failed (cancelled at the time limit counts as failed);
- prefix hit rate: 1 - (prompt tokens the workers computed) / (prompt tokens of the requests),
  where computed = admitted - cached (local prefix hits and blocks received over P2P), summed
  over both legs of every request, from the workers' ``/metrics`` counters before and after.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.bench_client import BenchConfig, run_benchmark
from loadtest.local_stack import RunningStack
from loadtest.serving_metrics import summarize
from loadtest.workloads import RequestOptions, WorkloadConfig, WorkloadKind


@dataclass(frozen=True, slots=True)
class QualityRow:
    mean_ttft_ms: float
    p99_ttft_ms: float
    hit_rate: float
    ok: int
    failed: int


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    groups: int,
    per_group: int,
    rate: float,
    time_limit_s: float,
    time_limit_help: str,
) -> None:
    """The workload's and the sim workers' flags (defaults differ per benchmark)."""
    parser.add_argument("--groups", type=int, default=groups)
    parser.add_argument("--per-group", type=int, default=per_group)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=rate, help="requests per second (Poisson)")
    parser.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    parser.add_argument("--decode-ms-per-step", type=float, default=2.0)
    parser.add_argument("--num-pages", type=int, default=2304, help="device pages per worker")
    parser.add_argument("--time-limit-s", type=float, default=time_limit_s, help=time_limit_help)


def describe(args: argparse.Namespace) -> str:
    return (
        f"{args.groups} groups x {args.per_group} prompts, {args.system_tokens}-token system "
        f"prompt + {args.question_tokens}-token question, {args.output_tokens} output tokens, "
        f"{args.rate:g} req/s; sim workers 2P+2C, {args.prefill_ms_per_token} ms per uncached "
        "prefill token"
    )


def stack_args(args: argparse.Namespace, router: str, *extra: str) -> list[str]:
    """``pdproxy.stack`` arguments: 2 producer + 2 consumer sim workers behind ``router``."""
    return [
        "--producers", "2", "--consumers", "2", "--model", "sim", "--router", router, *extra,
        f"--worker-arg=--sim-prefill-ms-per-token={args.prefill_ms_per_token}",
        f"--worker-arg=--sim-decode-ms-per-step={args.decode_ms_per_step}",
        f"--worker-arg=--num-pages={args.num_pages}",
        "--worker-arg=--max-model-len=4096",
    ]  # fmt: skip


def worker_urls(stack: RunningStack) -> list[str]:
    config = yaml.safe_load((stack.log_path.parent / "run" / "proxy.yaml").read_text())
    return [b["url"] for b in config["backends"]]


def worker_counters(urls: Sequence[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("kvtier_worker_") and sample.name.endswith("_total"):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def run(
    args: argparse.Namespace, stack: RunningStack, more_base_urls: tuple[str, ...] = ()
) -> QualityRow:
    """Send the workload to the stack (and to ``more_base_urls`` in turn), bounded by
    ``--time-limit-s``, and measure it."""
    urls = worker_urls(stack)
    before = worker_counters(urls)
    workload = WorkloadConfig(
        kind=WorkloadKind.SHARED_PREFIX,
        groups=args.groups,
        prompts_per_group=args.per_group,
        system_prompt_len=args.system_tokens,
        question_len=args.question_tokens,
        options=RequestOptions(model=stack.model, output_len=args.output_tokens),
    )
    bench = BenchConfig(
        base_url=stack.endpoint,
        more_base_urls=more_base_urls,
        request_rate=args.rate,
        max_duration_s=args.time_limit_s,
    )
    outcome = asyncio.run(run_benchmark(bench, workload))
    after = worker_counters(urls)
    summary = summarize(outcome.records, outcome.duration_s, detailed=False)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    admitted = delta.get("kvtier_worker_prompt_tokens_total", 0.0)
    hits = delta.get("kvtier_worker_prefix_hit_tokens_total", 0.0)
    sent = float(summary["total_input_tokens"]) or 1.0
    computed = max(admitted - hits, 0.0)  # a worker's hits include blocks fetched over P2P
    return QualityRow(
        float(summary["mean_ttft_ms"]),
        float(summary["p99_ttft_ms"]),
        1.0 - computed / sent,
        int(summary["completed"]),
        int(summary["failed"]) + outcome.cancelled,
    )
