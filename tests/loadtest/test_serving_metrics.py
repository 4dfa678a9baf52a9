from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.serving_metrics import format_table, parse_slos, percentile, summarize
from loadtest.stream_timing import ErrorKind, RequestRecord

floats = st.floats(min_value=0, max_value=1e4, allow_nan=False)


@given(st.lists(floats, min_size=1, max_size=50), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(values: list[float], p: float) -> None:
    ours = percentile(sorted(values), p)
    assert ours == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-9)


def _ok(
    ttft: float, e2el: float, out: int, itl: tuple[float, ...], cached: int = 0
) -> RequestRecord:
    return RequestRecord(
        tag="r",
        start_s=0.0,
        e2el_s=e2el,
        ok=True,
        ttft_s=ttft,
        itl_s=itl,
        prompt_tokens=10,
        output_tokens=out,
        cached_tokens=cached,
        text="x",
    )


def test_summary_has_vllm_keys_and_values() -> None:
    records = [
        _ok(0.1, 0.5, 5, (0.1, 0.1, 0.1, 0.1), cached=5),
        _ok(0.3, 0.7, 3, (0.2, 0.2)),
        RequestRecord(
            tag="f",
            start_s=0,
            e2el_s=0.01,
            ok=False,
            error=ErrorKind.SERVER_ERROR,
            error_detail="500",
        ),
    ]
    slos = parse_slos(["ttft:200"])
    result = summarize(records, duration_s=2.0, percentiles=(50, 99), slos=slos)
    assert result["completed"] == 2 and result["failed"] == 1
    assert result["total_input_tokens"] == 20 and result["total_output_tokens"] == 8
    assert result["request_throughput"] == 1.0
    assert result["request_goodput"] == 0.5  # only the first meets ttft <= 200 ms
    assert result["output_throughput"] == 4.0
    assert result["total_cached_tokens"] == 5 and result["cached_prompt_ratio"] == 0.25
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_tpot_ms"] == pytest.approx(150.0)  # tpots 100 and 200
    assert result["p99_itl_ms"] == pytest.approx(200.0)
    assert result["p50_e2el_ms"] == pytest.approx(600.0)
    assert result["error_counts"] == {"http_5xx": 1}
    assert result["errors"] == ["", "", "500"]
    table = format_table(result, (50, 99))
    assert "Serving Benchmark Result" in table and "P99 ITL (ms):" in table
    assert "Request goodput (req/s):" in table and "http_5xx:" in table
    assert "Cached prompt tokens (%):" in table


def test_goodput_absent_without_objectives_and_bad_objective_refused() -> None:
    assert summarize([], 1.0)["request_goodput"] is None
    with pytest.raises(ValueError, match="goodput"):
        parse_slos(["latency:5"])
