"""PNG plots from real benchmark results (bench_client against the fake OpenAI server)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.plots import PlotError, load_run, main, ratios

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _bench(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadtest.bench_client", "--base-url", url,
         "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
         "--system-prompt-len", "16", "--question-len", "4", "--output-len", "4",
         "--endpoint", "chat", "--max-concurrency", "2", "--max-duration", "20",
         "--result-json", str(out), *extra],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_bench_client_writes_plots_next_to_its_json(fake_openai_url: str, tmp_path: Path) -> None:
    result = tmp_path / "run.json"
    proc = _bench(fake_openai_url, result, "--plot")
    assert proc.returncode == 0, proc.stderr
    for name in ("run-latency.png", "run-throughput.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == PNG_MAGIC, name
        assert f"wrote {png}" in proc.stdout
    run = load_run(result)
    assert len(run.ttfts_ms) == 6 and len(run.finishes_s) == 6
    assert all(t > 0 for t in run.ttfts_ms) and len(run.itls_ms) == 6 * 3


def test_ratios_against_the_baseline(fake_openai_url: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert _bench(fake_openai_url, path).returncode == 0
    assert main([str(a), str(b), "--label", "base", "--label", "other", "--baseline", "base"]) == 0
    assert (tmp_path / "a-ratios.png").read_bytes()[:8] == PNG_MAGIC
    base, other = load_run(a, "base"), load_run(b, "other")
    table = ratios([base, other], base)
    assert set(table) == {"other"}
    row = table["other"]
    assert math.isclose(row["p50 TTFT"], other.quantile("ttft", 50) / base.quantile("ttft", 50))
    assert math.isclose(row["throughput"], other.throughput / base.throughput)
    assert ratios([base], base) == {}


def test_a_result_without_details_is_refused(tmp_path: Path) -> None:
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"completed": 1, "duration": 1.0}))
    with pytest.raises(PlotError, match="no per-request details"):
        load_run(bare)
    with pytest.raises(SystemExit):
        main([str(bare), str(tmp_path / "missing.json")])
