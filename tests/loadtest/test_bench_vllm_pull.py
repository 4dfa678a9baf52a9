"""``loadtest.bench_vllm_pull``'s report: same-run ratios from the legs it measured (the vLLM
part runs only as the benchmark itself)."""

from __future__ import annotations

from loadtest.bench_vllm_pull import report


def test_report_prints_legs_and_same_run_ratios() -> None:
    legs = {
        "cold": {"producer": [1.0, 2.0, 3.0], "consumer": [0.5] * 3, "total": [1.5, 2.5, 3.5]},
        "warm": {"producer": [0.2, 0.4, 0.6], "consumer": [0.25, 0.25, 0.25], "total": [1.0] * 3},
        "pull": {"consumer": [0.5, 0.5, 0.5]},
    }
    text = report(legs)
    assert "cold   producer      2000" in text
    assert "warm/cold p50: producer leg 0.20, PD total 0.40" in text
    assert "pull/consumer leg p50: cold 1.00, warm 2.00 (rounds: 3)" in text
