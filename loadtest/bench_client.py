"""Bounded asyncio benchmark client for OpenAI endpoints (vLLM-bench-style JSON and table).

    python -m loadtest.bench_client --base-url http://127.0.0.1:8000 \\
        --workload shared-prefix --groups 4 --prompts-per-group 8 \\
        --request-rate 8 --max-duration 60 --result-json result.json

Open loop: sessions start at Poisson arrivals of ``--request-rate`` per second (``inf``: all
at once; ``--burstiness`` shapes the gaps as vLLM's does), optionally capped by
``--max-concurrency`` requests in flight; ``--request-rate inf --max-concurrency N`` is a
fixed-concurrency (closed-loop) run. Multi-turn conversations run their turns back to back, so
the rate is the rate of new conversations. Bounded by the workload's size and
``--max-duration`` (requests still running then are cancelled and counted).

Against the local stack in one command (started for the run, stopped after)::

    python -m loadtest.bench_client --local-stack --stack-arg=--model --stack-arg=sim \
        --workload shared-prefix --max-concurrency 4 --max-duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from loadtest import workloads
from loadtest.local_stack import local_stack
from loadtest.model_discovery import served_model
from loadtest.serving_metrics import Slo, format_table, parse_slos, summarize
from loadtest.stream_timing import (
    ErrorKind,
    RequestRecord,
    SSEDecoder,
    StreamTimer,
    classify_status,
    failed,
    record_from_json,
)
from loadtest.workloads import Endpoint


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str
    request_rate: float = math.inf
    burstiness: float = 1.0
    """Gamma shape of inter-arrival times: 1 is Poisson, < 1 burstier, > 1 more uniform."""
    max_concurrency: int | None = None
    max_duration_s: float = 60.0
    request_timeout_s: float = 120.0
    api_key: str | None = None
    seed: int = 0
    progress: bool = False
    more_base_urls: tuple[str, ...] = ()
    """Other replicas of the same service: requests go to ``base_url`` and these in turn."""


@dataclass(frozen=True, slots=True)
class BenchOutcome:
    records: list[RequestRecord]
    duration_s: float
    cancelled: int
    """Requests still in flight at ``max_duration_s`` (cancelled, not in ``records``)."""
    max_in_flight: int


class Progress:
    """A one-line progress bar on a terminal (silent when disabled)."""

    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self._total = max(total, 1)
        self._out = out
        self._enabled = enabled
        self._ok = 0
        self._failed = 0
        self._t0 = time.perf_counter()
        self._drawn = 0.0

    def update(self, record: RequestRecord) -> None:
        if record.ok:
            self._ok += 1
        else:
            self._failed += 1
        now = time.perf_counter()
        if self._enabled and (now - self._drawn > 0.1 or self._ok + self._failed >= self._total):
            self._drawn = now
            done = self._ok + self._failed
            filled = int(30 * min(done, self._total) / self._total)
            rate = done / max(now - self._t0, 1e-9)
            bar = "#" * filled + "." * (30 - filled)
            self._out.write(
                f"\r[{bar}] {done}/{self._total} ok={self._ok} failed={self._failed} "
                f"{rate:.1f} req/s"
            )
            self._out.flush()

    def close(self) -> None:
        if self._enabled:
            self._out.write("\n")
            self._out.flush()


async def send_request(
    http: aiohttp.ClientSession,
    base_url: str,
    spec: workloads.RequestSpec,
    headers: dict[str, str],
    clock0: float,
) -> RequestRecord:
    """Send one request and time it; every failure becomes a classified record."""
    start = time.perf_counter()
    rel = start - clock0
    got_response = False
    try:
        async with http.post(base_url + spec.endpoint, json=spec.body, headers=headers) as resp:
            got_response = True
            kind = classify_status(resp.status)
            if kind is not None:
                body = await resp.read()
                detail = body.decode(errors="replace")
                return _shift(failed(spec.tag, start, time.perf_counter(), kind, detail), rel)
            if not spec.stream:
                body = await resp.read()
                record = record_from_json(
                    spec.tag, start, time.perf_counter(), body, spec.prompt_len
                )
                return _shift(record, rel)
            timer = StreamTimer(spec.tag, start, spec.prompt_len)
            decoder = SSEDecoder()
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                for payload in decoder.feed(chunk):
                    timer.on_payload(payload, now)
            now = time.perf_counter()
            for payload in decoder.flush():
                timer.on_payload(payload, now)
            return _shift(timer.finish(now), rel)
    except TimeoutError as exc:
        kind, detail = ErrorKind.TIMEOUT, repr(exc)
    except aiohttp.ClientPayloadError as exc:
        kind, detail = ErrorKind.TRUNCATED, repr(exc)
    except (aiohttp.ClientError, OSError) as exc:
        kind = ErrorKind.TRUNCATED if got_response else ErrorKind.CONNECT
        detail = repr(exc)
    return _shift(failed(spec.tag, start, time.perf_counter(), kind, detail), rel)


def _shift(record: RequestRecord, rel_start: float) -> RequestRecord:
    """Put ``start_s`` on the run's clock (seconds since the run began)."""
    return dataclasses.replace(record, start_s=rel_start)


async def run_benchmark(
    config: BenchConfig, workload: workloads.WorkloadConfig, progress_out: TextIO = sys.stderr
) -> BenchOutcome:
    sessions = list(workloads.sessions(workload))
    progress = Progress(workloads.total_requests(workload), progress_out, config.progress)
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    rng = random.Random(config.seed)
    records: list[RequestRecord] = []
    urls = (config.base_url, *config.more_base_urls)
    in_flight = 0
    max_in_flight = 0
    counter = 0

    async def run_session(http: aiohttp.ClientSession, session: workloads.Session) -> None:
        nonlocal in_flight, max_in_flight, counter
        while (spec := session.next_request()) is not None:
            counter += 1
            req_headers = dict(headers, **{"X-Request-Id": f"bench-{config.seed}-{counter}"})
            async with limit if limit is not None else contextlib.nullcontext():
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                try:
                    url = urls[counter % len(urls)]
                    record = await send_request(http, url, spec, req_headers, clock0)
                finally:
                    in_flight -= 1
            records.append(record)
            progress.update(record)
            session.record_answer(record.text)

    async def arrivals(http: aiohttp.ClientSession, tasks: list[asyncio.Task[None]]) -> None:
        for session in sessions:
            if math.isfinite(config.request_rate) and config.request_rate > 0:
                shape = config.burstiness
                await asyncio.sleep(rng.gammavariate(shape, 1.0 / (config.request_rate * shape)))
            tasks.append(asyncio.create_task(run_session(http, session)))
        if tasks:
            await asyncio.wait(tasks)

    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    tasks: list[asyncio.Task[None]] = []
    clock0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        driver = asyncio.create_task(arrivals(http, tasks))
        try:
            await asyncio.wait_for(asyncio.shield(driver), config.max_duration_s)
        except TimeoutError:
            driver.cancel()
        finally:
            cancelled = in_flight
            for task in tasks:
                task.cancel()
            await asyncio.gather(driver, *tasks, return_exceptions=True)
    duration = time.perf_counter() - clock0
    progress.close()
    return BenchOutcome(records, duration, cancelled, max_in_flight)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--local-stack",
        action="store_true",
        help="start the local PD stack (python -m pdproxy.stack) for this run and stop it after",
    )
    parser.add_argument(
        "--stack-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="flag for the local stack (repeatable), e.g. --stack-arg=--model --stack-arg=sim",
    )
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s (inf)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--max-duration", type=float, default=60.0, help="seconds, hard bound")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS")
    parser.add_argument("--metric-percentiles", default="99", help='e.g. "50,90,99"')
    parser.add_argument("--result-json", type=Path, default=None)
    parser.add_argument(
        "--plot", action="store_true", help="also write PNG plots next to --result-json"
    )
    parser.add_argument("--no-details", action="store_true", help="omit per-request arrays")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None)
    progress.add_argument("--no-progress", dest="progress", action="store_false")
    workloads.add_workload_arguments(parser)
    return parser


def result_document(
    outcome: BenchOutcome,
    *,
    config: BenchConfig,
    workload: workloads.WorkloadConfig,
    percentiles: Sequence[float],
    slos: Sequence[Slo],
    detailed: bool,
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if workload.options.endpoint is Endpoint.CHAT else "openai",
        "base_url": config.base_url,
        "model_id": workload.options.model,
        "workload": workload.kind.value,
        "num_prompts": workloads.total_requests(workload),
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "cancelled": outcome.cancelled,
        "max_concurrent_requests": outcome.max_in_flight,
    }
    doc.update(summarize(outcome.records, outcome.duration_s, percentiles, slos, detailed))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.local_stack:
        return run_and_report(args)
    with local_stack(args.stack_arg) as stack:
        print(f"local stack ready at {stack.endpoint} (log: {stack.log_path})", flush=True)
        args.base_url = stack.endpoint
        return run_and_report(args)


def run_and_report(args: argparse.Namespace) -> int:
    if not args.model:
        args.model = served_model(args.base_url, args.api_key)
    percentiles = [float(p) for p in str(args.metric_percentiles).split(",") if p.strip()]
    slos = parse_slos(args.goodput)
    workload = workloads.config_from_arguments(args)
    config = BenchConfig(
        base_url=args.base_url.rstrip("/"),
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        seed=args.seed,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    outcome = asyncio.run(run_benchmark(config, workload))
    doc = result_document(
        outcome,
        config=config,
        workload=workload,
        percentiles=percentiles,
        slos=slos,
        detailed=not args.no_details,
    )
    print(format_table(doc, percentiles))
    if outcome.cancelled:
        print(f"{outcome.cancelled} requests still running at --max-duration were cancelled")
    if args.result_json is not None:
        args.result_json.write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.result_json}")
        if args.plot:
            from loadtest.plots import plot_result  # matplotlib only when asked for

            for path in plot_result(args.result_json):
                print(f"wrote {path}")
    return 0 if doc["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
