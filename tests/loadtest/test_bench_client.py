from __future__ import annotations

import dataclasses
import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path

from loadtest import workloads as wl
from loadtest.bench_client import BenchConfig, run_benchmark
from loadtest.stream_timing import ErrorKind


def _workload(kind: wl.WorkloadKind, model: str = "m", **sizes: int) -> wl.WorkloadConfig:
    options = wl.RequestOptions(model=model, output_len=4)
    return dataclasses.replace(wl.WorkloadConfig(kind=kind, options=options), **sizes)


async def test_fixed_concurrency_shared_prefix_run(fake_openai_url: str) -> None:
    workload = _workload(
        wl.WorkloadKind.SHARED_PREFIX,
        groups=2,
        prompts_per_group=3,
        system_prompt_len=20,
        question_len=5,
    )
    config = BenchConfig(base_url=fake_openai_url, max_concurrency=2, max_duration_s=30)
    out = io.StringIO()
    outcome = await run_benchmark(config, workload, progress_out=out)
    assert len(outcome.records) == 6 and outcome.cancelled == 0
    assert all(r.ok for r in outcome.records)
    assert outcome.max_in_flight == 2
    for r in outcome.records:
        assert r.text == " t0 t1 t2 t3" and r.output_tokens == 4
        assert r.prompt_tokens == 26  # the fake counts characters: 20 + "\n" + 5
        assert r.ttft_s is not None and len(r.itl_s) == 3
    assert out.getvalue() == ""  # progress disabled


async def test_multi_turn_chat_feeds_answers_back(fake_openai_url: str) -> None:
    workload = _workload(
        wl.WorkloadKind.MULTI_TURN, conversations=2, turns=3, system_prompt_len=8, question_len=4
    )
    config = BenchConfig(base_url=fake_openai_url, progress=True)
    out = io.StringIO()
    outcome = await run_benchmark(config, workload, progress_out=out)
    assert len(outcome.records) == 6 and all(r.ok for r in outcome.records)
    by_turn = {r.tag: r for r in outcome.records}
    # Each turn resends the history: system 8 + questions 4 each + answers 12 chars each.
    assert by_turn["conv-0/turn-0"].prompt_tokens == 12
    assert by_turn["conv-0/turn-1"].prompt_tokens == 12 + 12 + 4
    assert by_turn["conv-0/turn-2"].prompt_tokens == 12 + 2 * 16
    assert "6/6" in out.getvalue()


async def test_errors_are_classified(fake_openai_url: str) -> None:
    for model, kind in [
        ("fail-500", ErrorKind.SERVER_ERROR),
        ("fail-429", ErrorKind.RATE_LIMITED),
        ("stream-error", ErrorKind.STREAM_ERROR),
        ("cut", ErrorKind.TRUNCATED),
    ]:
        workload = _workload(wl.WorkloadKind.RANDOM, model=model, num_prompts=2, input_len=8)
        outcome = await run_benchmark(BenchConfig(base_url=fake_openai_url), workload)
        assert [r.error for r in outcome.records] == [kind, kind], model
    dead = BenchConfig(base_url="http://127.0.0.1:9", request_timeout_s=5)
    workload = _workload(wl.WorkloadKind.RANDOM, num_prompts=1, input_len=8)
    outcome = await run_benchmark(dead, workload)
    assert outcome.records[0].error is ErrorKind.CONNECT


async def test_poisson_arrivals_are_bounded_by_max_duration(fake_openai_url: str) -> None:
    # 100 prompts at 5 req/s would take ~20 s; the run must stop at 1 s.
    workload = _workload(wl.WorkloadKind.RANDOM, num_prompts=100, input_len=8)
    config = BenchConfig(base_url=fake_openai_url, request_rate=5.0, max_duration_s=1.0)
    t0 = time.monotonic()
    outcome = await run_benchmark(config, workload)
    assert time.monotonic() - t0 < 5
    assert 0 < len(outcome.records) < 30
    starts = [r.start_s for r in outcome.records]
    assert starts == sorted(starts) and max(starts) < 1.0


def test_cli_writes_vllm_style_json_and_table(fake_openai_url: str, tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_client", "--base-url", fake_openai_url,
         "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "2",
         "--system-prompt-len", "16", "--question-len", "4", "--output-len", "3",
         "--endpoint", "chat", "--max-concurrency", "2", "--max-duration", "20",
         "--goodput", "ttft:5000", "--metric-percentiles", "50,99",
         "--result-json", str(result)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "P99 TTFT (ms):" in proc.stdout
    doc = json.loads(result.read_text())
    assert doc["completed"] == 4 and doc["failed"] == 0 and doc["backend"] == "openai-chat"
    assert doc["model_id"] == "fake-model"  # no --model: the server's first model
    assert doc["request_goodput"] == doc["request_throughput"]
    for key in (
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "p50_e2el_ms",
        "std_e2el_ms",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    ):
        assert math.isfinite(doc[key]) and doc[key] >= 0, key
    assert doc["total_output_tokens"] == 12 and len(doc["itls"]) == 4
