"""``loadtest.bench_p2p`` end to end on a tiny shape, both ways of running the producer: every
row is measured and printed (a fetch that comes back incomplete makes the benchmark fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ends", ["processes", "threads"])
def test_bench_p2p_measures_every_row(ends: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.bench_p2p",
            *("--tokens", "512", "--token-kib", "4", "--repeat", "2", "--ends", ends),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert f"producer and consumer in separate {ends}" in out
    assert "512 tokens x 4 KiB/token = 2 MiB in 32 pages of 64 KiB" in out
    for mode in ("loop", "thread"):
        for kind in ("cold", "warm"):
            assert f"{kind} fetch (verify on the {mode}) vs raw speed, paired median:" in out
            assert f"{kind} fetch (verify on the {mode}) vs raw socket + page MAC" in out
    assert "raw socket + page MAC vs raw speed, paired median:" in out
    assert out.count("x raw speed") == 6  # the floor, four fetch rows and the MAC row
    assert "CPU-bound ceiling" in out and "warm/cold time" in out
