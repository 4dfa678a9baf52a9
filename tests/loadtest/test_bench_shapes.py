"""The guard on predicted TTFT: on the prefix-heavy shape (many conversations, each its own
prefix, KV smaller than the working set), the KV router with prediction on reuses the prefix as
well as the cost model without it (issue 35: its pool computed 0.72 of the prompt tokens
against 0.47)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from loadtest.bench_shapes import Cell, guard


def _cell(cached: float, computed: float, ms: float, failed: int = 0) -> Cell:
    c = Cell(ttft_s=[ms / 1e3] * 10, failed=failed, prompt_tokens=1000)
    c.cached_tokens = round(cached * 1000)
    c.computed_tokens = computed * 1000
    return c


def test_the_guard_fails_the_regression_it_was_written_for_and_passes_noise() -> None:
    """The figures of the regression (cd16ab9 on this shape) fail it; a run within its margins
    passes; failed requests fail it whatever the shares."""
    regressed = {"conversations": {"ttft": _cell(0.39, 0.72, 77), "cost": _cell(0.80, 0.47, 175)}}
    failures = guard(regressed, 0.10, 2.0)
    assert failures == ["conversations: ttft computed 0.72 > cost 0.47 + 0.1"]
    # More served alone: consumers report fewer cached tokens, the pool computes no more.
    alone = {"conversations": {"ttft": _cell(0.81, 0.31, 48), "cost": _cell(0.92, 0.32, 68)}}
    assert guard(alone, 0.10, 2.0) == []
    slow = {"conversations": {"ttft": _cell(0.95, 0.28, 150), "cost": _cell(0.96, 0.27, 60)}}
    assert [f for f in guard(slow, 0.10, 2.0) if "mean" in f]
    fine = {"conversations": {"ttft": _cell(0.90, 0.33, 70), "cost": _cell(0.96, 0.27, 60)}}
    assert guard(fine, 0.10, 2.0) == []
    broken = {
        "conversations": {"ttft": _cell(0.96, 0.27, 60, failed=1), "cost": _cell(0.96, 0.27, 60)}
    }
    assert guard(broken, 0.10, 2.0)
    assert guard({"conversations": {"ttft": _cell(0.1, 0.9, 500)}}, 0.10, 2.0) == []  # one side


@pytest.mark.slow
def test_prediction_keeps_the_prefix_on_many_conversations() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_shapes", "--shapes", "conversations",
         "--routers", "ttft", "cost", "--guard", "--settle", "1"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    rows = re.findall(r"^\| conversations \| (\w+) \| (\d+) \| (\d+) \|", done.stdout, re.M)
    assert {name for name, _, _ in rows} == {"ttft", "cost"}, done.stdout + done.stderr[-4000:]
    assert all(sent == "96" and failed == "0" for _, sent, failed in rows), done.stdout
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "guard: ok" in done.stdout
