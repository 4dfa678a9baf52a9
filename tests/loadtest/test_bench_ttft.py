"""bench_ttft end to end at a trickle: the pool, both pdproxy configurations and the report."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_ttft_serves_every_request_through_both_pdproxy_configurations() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_ttft", "--rates", "2", "--seconds", "3",
         "--settle", "0.5", "--proxies", "ttft", "cost", "--quiet-seconds", "2"],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {
        m["proxy"]: m
        for m in re.finditer(
            r"^\|\s+2\.0 \| (?P<proxy>\w+)\s+\| (?P<slo>[\d.]+)% .*\| +(?P<failed>\d+) \|[^|]*\|$",
            done.stdout,
            re.MULTILINE,
        )
    }
    assert set(rows) == {"ttft", "cost"}, done.stdout
    assert all(row["failed"] == "0" for row in rows.values()), done.stdout
    assert "quiet median TTFT" in done.stdout
