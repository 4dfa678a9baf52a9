"""Serving metrics from raw per-request records: vLLM-bench-style summary and a short table.

Besides vLLM's keys, ``total_cached_tokens`` / ``cached_prompt_ratio`` sum what servers report
as ``usage.prompt_tokens_details.cached_tokens``: behind a PD proxy that is every prompt token
the consumer did not compute (its prefix cache *or* KV received from a producer).

Percentiles are exact over every raw sample (linear interpolation between closest ranks, the
same rule as ``numpy.percentile``'s default), unlike Locust's rounded histogram buckets.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.stream_timing import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
LABELS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass(frozen=True, slots=True)
class Slo:
    """A goodput service-level objective: ``metric`` (ttft, tpot or e2el) at most ``limit_ms``."""

    metric: str
    limit_ms: float


def parse_slos(items: Iterable[str]) -> list[Slo]:
    """``["ttft:500", "tpot:50"]`` → SLOs (vLLM's ``--goodput`` syntax)."""
    slos = []
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad goodput objective {item!r}: want ttft|tpot|e2el:MILLISECONDS")
        slos.append(Slo(name, float(value)))
    return slos


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of already sorted values, linearly interpolated."""
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of unsorted ``values``: the sample at the nearest rank, no
    interpolation (the few-sample benchmarks' rule: every figure is a measured one)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _samples(records: Sequence[RequestRecord], metric: str) -> list[float]:
    ok = [r for r in records if r.ok]
    if metric == "ttft":
        return [r.ttft_s for r in ok if r.ttft_s is not None]
    if metric == "tpot":
        return [t for r in ok if (t := r.tpot_s) is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl_s]
    return [r.e2el_s for r in ok]


def _meets(record: RequestRecord, slos: Sequence[Slo]) -> bool:
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2el": record.e2el_s}
    for slo in slos:
        value = values[slo.metric]
        if value is not None and value * 1000 > slo.limit_ms:
            return False
    return True


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (99,),
    slos: Sequence[Slo] = (),
    detailed: bool = True,
) -> dict[str, Any]:
    """The vLLM-bench result dictionary (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
    ok = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    total_cached = sum(r.cached_tokens for r in ok)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(_meets(r, slos) for r in ok) / duration) if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "total_cached_tokens": total_cached,
        "cached_prompt_ratio": total_cached / total_in if total_in else 0.0,
        "error_counts": dict(Counter(str(r.error) for r in records if not r.ok)),
    }
    for metric in METRICS:
        values = sorted(_samples(records, metric))
        result[f"mean_{metric}_ms"] = statistics.fmean(values) * 1000 if values else 0.0
        result[f"median_{metric}_ms"] = percentile(values, 50) * 1000
        result[f"std_{metric}_ms"] = statistics.pstdev(values) * 1000 if values else 0.0
        for p in percentiles:
            result[f"p{p:g}_{metric}_ms"] = percentile(values, p) * 1000
    if detailed:
        result["input_lens"] = [r.prompt_tokens for r in records]
        result["output_lens"] = [r.output_tokens for r in records]
        result["ttfts"] = [r.ttft_s or 0.0 for r in records]
        result["itls"] = [list(r.itl_s) for r in records]
        result["start_times"] = [r.start_s for r in records]
        result["e2els"] = [r.e2el_s for r in records]
        result["errors"] = [r.error_detail if not r.ok else "" for r in records]
    return result


def format_table(result: dict[str, Any], percentiles: Sequence[float] = (99,)) -> str:
    """vLLM's 'Serving Benchmark Result' block, compact."""
    width = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="=")]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Benchmark duration (s):", float(result["duration"]))
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", float(result["request_throughput"]))
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", float(result["request_goodput"]))
    row("Output token throughput (tok/s):", float(result["output_throughput"]))
    row("Total Token throughput (tok/s):", float(result["total_token_throughput"]))
    row("Cached prompt tokens (%):", 100.0 * float(result["cached_prompt_ratio"]))
    for metric in METRICS:
        lines.append("{s:{c}^{n}}".format(s=LABELS[metric], n=width, c="-"))
        name = metric.upper()
        row(f"Mean {name} (ms):", float(result[f"mean_{metric}_ms"]))
        row(f"Median {name} (ms):", float(result[f"median_{metric}_ms"]))
        for p in percentiles:
            row(f"P{p:g} {name} (ms):", float(result[f"p{p:g}_{metric}_ms"]))
    if result["error_counts"]:
        lines.append("{s:{c}^{n}}".format(s="Errors", n=width, c="-"))
        for kind, count in sorted(result["error_counts"].items()):
            row(f"{kind}:", count)
    lines.append("=" * width)
    return "\n".join(lines)
