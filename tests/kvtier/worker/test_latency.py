"""The engine's per-token latency histograms, exposed as Prometheus reads them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.worker.latency import LATENCY_BUCKETS, LatencyHistogram


@given(st.lists(st.floats(min_value=0, max_value=200, allow_nan=False), max_size=50))
def test_cumulative_buckets_count_every_observation_once(values: list[float]) -> None:
    hist = LatencyHistogram()
    for v in values:
        hist.observe(v)
    buckets = hist.cumulative()
    assert [le for le, _ in buckets][-1] == "+Inf" and len(buckets) == len(LATENCY_BUCKETS) + 1
    counts = [n for _, n in buckets]
    assert counts == sorted(counts) and counts[-1] == hist.count == len(values)
    for (le, n), bound in zip(buckets, LATENCY_BUCKETS, strict=False):
        assert n == sum(1 for v in values if v <= bound), le
