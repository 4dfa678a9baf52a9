"""The proxy benchmark runs end to end (tiny and bounded); its figures are not asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_proxy_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_proxy", "--duration", "0.2",
         "--max-requests", "40", "--concurrency", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "proxy vs floor" in out
    rows = [line for line in out.splitlines() if line.startswith(("nonstream", "stream64"))]
    assert len(rows) == 4
    assert all(line.split()[-1] == "0" for line in rows)  # no request failed


@pytest.mark.slow
def test_bench_http1_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_http1", "--rounds", "1", "--duration", "0.2",
         "--max-requests", "40", "--concurrency", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "against the floor" in out
    rows = [line for line in out.splitlines() if line.startswith(("nonstream", "stream64"))]
    assert {line.split()[2] for line in rows} == {"floor", "http1", "aiohttp"}
    assert len(rows) == 6


def test_bench_proxy_compares_against_a_baseline_tree() -> None:
    repo = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_proxy", "--duration", "0.2",
         "--max-requests", "40", "--concurrency", "1", "--baseline-tree", repo],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith(("nonstream", "stream64"))]
    assert len(rows) == 6 and all(line.split()[-1] == "0" for line in rows)
    assert "this proxy vs the baseline tree" in out
    assert len([line for line in out.splitlines() if "CPU/req" in line]) == 2


def test_a_baseline_that_measured_no_cpu_is_reported_not_divided_by(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # CPU is read in clock ticks: a short cell under load can measure 0 for the baseline (CI).
    from loadtest.bench_proxy import Cell, _report

    def cell(mode: str, cpu_ms: float) -> Cell:
        return Cell(mode, "json", 1, 40, 0, 0.3, 1.0, 2.0, 1.0, cpu_ms, 0.5)

    _report([cell("floor", 0.0), cell("baseline", 0.0), cell("pdproxy", 0.25)])
    out = capsys.readouterr().out
    assert "CPU/req 0.000 -> 0.250 ms (no ratio: the baseline measured 0" in out
    assert "req/s x1.00" in out
