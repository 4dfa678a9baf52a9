"""CPU of ``/metrics`` with N proxy processes, three ways (the figures in
:mod:`pdproxy.serve.metrics_merge`): the text merge (before issue 30), the samples merge (now),
and ``prometheus_client``'s multiprocess mode (not taken). Not a test: run it::

    .venv/bin/python -m tests.pdproxy.serve.measure_metrics_merge

The series are a proxy's with 24 backends (~94 KiB of exposition per process). Process CPU
time, best of three.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdproxy.observe.metrics import _LATENCY_BUCKETS
from pdproxy.serve.metrics_merge import collected, families_of, merge_expositions, merge_samples
from pdproxy.serve.metrics_merge import samples_json as samples_of

_MODULE = "tests.pdproxy.serve.measure_metrics_merge"
_BACKENDS = 24
_COUNTS = (2, 4, 8, 16)


def _populate(registry: CollectorRegistry | None) -> tuple[Any, Any]:
    """A proxy's series; ``registry`` None: prometheus_client's default (multiprocess mode)."""
    r: dict[str, Any] = {} if registry is None else {"registry": registry}
    requests = Counter("pdproxy_requests", "x", ["route", "status", "dialect"], **r)
    legs = Histogram(
        "pdproxy_leg_latency_seconds", "x", ["leg", "backend"], buckets=_LATENCY_BUCKETS, **r
    )
    failures = Counter("pdproxy_upstream_failures", "x", ["backend", "kind"], **r)
    mode = {"multiprocess_mode": "sum"} if registry is None else {}
    in_flight = Gauge("pdproxy_backend_in_flight", "x", ["backend"], **mode, **r)
    for route in ("completions", "chat"):
        for status in ("200", "429", "502"):
            requests.labels(route, status, "nixl").inc(3)
    for b in range(_BACKENDS):
        for leg in ("producer", "consumer"):
            legs.labels(leg, f"backend-{b}").observe(0.1)
        for kind in ("transport", "timeout", "status_5xx"):
            failures.labels(f"backend-{b}", kind).inc()
        in_flight.labels(f"backend-{b}").set(1)
    return requests.labels("completions", "200", "nixl"), legs.labels("consumer", "backend-1")


def _cpu(fn: Callable[[], object], n: int) -> float:
    best = []
    for _ in range(3):
        started = time.process_time()
        for _ in range(n):
            fn()
        best.append((time.process_time() - started) / n)
    return min(best)


def _multiprocess(count: int) -> None:
    """In a child with PROMETHEUS_MULTIPROC_DIR set: ``count`` processes' files, one scrape."""
    from prometheus_client import multiprocess

    for _ in range(count - 1):
        subprocess.run([sys.executable, "-m", _MODULE, "--populate"], check=True)
    counter, histogram = _populate(None)
    hot = _cpu(lambda: (counter.inc(), histogram.observe(0.2)), 100_000)

    def scrape() -> bytes:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    print(
        f"multiprocess mode, {count:2d} processes: {_cpu(scrape, 5) * 1e3:6.1f} ms per scrape; "
        f"hot path inc+observe {hot * 1e9:.0f} ns"
    )


def main() -> None:
    registry = CollectorRegistry()
    counter, histogram = _populate(registry)
    text = generate_latest(registry).decode()
    own = _cpu(lambda: generate_latest(registry), 50)
    hot = _cpu(lambda: (counter.inc(), histogram.observe(0.2)), 100_000)
    print(f"one process: {len(text) / 1024:.0f} KiB, /metrics {own * 1e3:.1f} ms; "
          f"hot path inc+observe {hot * 1e9:.0f} ns")  # fmt: skip
    blob = samples_of(registry)
    sibling = _cpu(lambda: samples_of(registry), 50)
    for n in _COUNTS:
        texts = [text] * n
        before = _cpu(lambda: merge_expositions(texts), 3)  # noqa: B023 - called in this turn
        now = _cpu(
            lambda: merge_samples(
                [collected(registry)] + [families_of(blob) for _ in range(n - 1)]  # noqa: B023
            ),
            5,
        )
        print(
            f"{n:2d} processes: text merge {before * 1e3:6.1f} ms (+{own * 1e3:.1f} ms per "
            f"sibling); samples merge {now * 1e3:5.1f} ms (+{sibling * 1e3:.1f} ms per sibling)"
        )
    for n in _COUNTS:
        with tempfile.TemporaryDirectory() as directory:
            env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory}
            subprocess.run(
                [sys.executable, "-m", _MODULE, "--multiprocess", str(n)], env=env, check=True
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--populate"]:
        _populate(None)
    elif sys.argv[1:2] == ["--multiprocess"]:
        _multiprocess(int(sys.argv[2]))
    else:
        main()
