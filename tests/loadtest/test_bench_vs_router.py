"""bench_vs_router's pieces that need neither vllm-router nor wrk installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loadtest.bench_vs_router import parse_wrk, tree_cpu_seconds

_WRK = """Running 3s test @ http://127.0.0.1:1/v1/completions
  2 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     7.10ms    3.21ms  48.00ms   80.00%
  Latency Distribution
     50%  650.00us
     75%    8.10ms
     90%   11.20ms
     99%    1.20s
  6500 requests in 3.01s, 2.10MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:   2159.47
"""


def test_wrk_report_is_read() -> None:
    run = parse_wrk(_WRK)
    assert run.errors == 7 and run.requests == 6493
    assert run.seconds == pytest.approx(3.01)
    assert run.latency_ms == pytest.approx({50: 0.65, 99: 1200.0})


def test_a_report_without_summary_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no summary"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_tree_cpu_counts_children() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 2: pass\n"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}]); "
         "import time; time.sleep(30)"],
    )  # fmt: skip
    try:
        deadline = 100
        while deadline and tree_cpu_seconds(parent.pid) < 0.3:
            deadline -= 1
            os.sched_yield()
            subprocess.run(["sleep", "0.05"], check=True)
        # The parent spins nothing: what shows is its child's time, counted while it runs.
        assert deadline, "the child's CPU time never showed in the tree"
    finally:
        parent.kill()
        parent.wait(5)
