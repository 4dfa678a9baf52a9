"""The Locust file runs for real, in a subprocess (importing locust here would monkey-patch)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


def _locust(
    host: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[str, dict]:
    exe = shutil.which("locust", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("locust is not installed in the venv (dev extra)")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [exe, "-f", str(LOCUSTFILE), "--headless", "-u", "3", "-r", "3", "-t", "2s",
         "--host", host, "--report-json", str(report), "--only-summary", *args],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert report.exists(), out
    return out, json.loads(report.read_text())


def test_locust_multi_turn_chat_reports_exact_percentiles(
    fake_openai_url: str, tmp_path: Path
) -> None:
    out, report = _locust(
        fake_openai_url, tmp_path, "--workload", "multi-turn", "--conversations", "2",
        "--turns", "3", "--system-prompt-len", "16", "--question-len", "4", "--output-len", "4",
    )  # fmt: skip
    assert report["completed"] > 0 and report["failed"] == 0, out
    assert report["workload"] == "multi-turn" and report["generator"] == "locust"
    # Chat turns grow: later turns resend earlier answers, so prompt lengths differ.
    assert len(set(report["input_lens"])) > 1
    assert report["total_output_tokens"] == 4 * report["completed"]
    assert 0 < report["median_ttft_ms"] <= report["p99_ttft_ms"]
    assert report["mean_itl_ms"] > 0 and report["mean_tpot_ms"] > 0
    # Locust's own table carries the custom metric events and the chat endpoint.
    for name in ("METRIC", "TTFT", "ITL", "TPOT", "/v1/chat/completions stream"):
        assert name in out
    assert "Serving Benchmark Result" in out


def test_locust_classifies_errors_and_reads_env_configuration(
    fake_openai_url: str, tmp_path: Path
) -> None:
    env = {
        "PATH": str(Path(sys.executable).parent),
        "LOCUST_WORKLOAD": "random",
        "LOCUST_MODEL": "fail-500",
        "LOCUST_NUM_PROMPTS": "3",
        "LOCUST_INPUT_LEN": "8",
    }
    out, report = _locust(fake_openai_url, tmp_path, env=env)
    assert report["completed"] == 0 and report["failed"] > 0, out
    assert report["error_counts"] == {"http_5xx": report["failed"]}
    assert report["model_id"] == "fail-500"
    assert "http_5xx" in out


def test_distributed_run_reports_every_workers_samples(
    fake_openai_url: str, tmp_path: Path
) -> None:
    out, report = _locust(
        fake_openai_url, tmp_path, "--processes", "2", "--csv", str(tmp_path / "stats"),
        "--workload", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "3",
    )  # fmt: skip
    rows = (tmp_path / "stats_stats.csv").read_text().splitlines()
    post = next(r for r in rows if r.startswith("POST,"))
    locust_count = int(post.split(",")[2])
    assert report["completed"] == locust_count > 0, out
    assert report["failed"] == 0 and len(report["ttfts"]) == locust_count
