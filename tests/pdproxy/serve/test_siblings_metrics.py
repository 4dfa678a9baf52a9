"""Merging the processes' ``/metrics`` and splitting admission limits over processes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from pdproxy.serve.process_group import per_process_settings, process_count
from pdproxy.serve.siblings import merge_expositions
from pdproxy.settings import AdmissionSettings, ProxySettings


class _Gauges:
    def __init__(self, in_flight: float, breaker: float) -> None:
        self._in_flight, self._breaker = in_flight, breaker

    def collect(self) -> list[GaugeMetricFamily]:
        a = GaugeMetricFamily("pdproxy_backend_in_flight", "x", labels=["backend"])
        a.add_metric(["d"], self._in_flight)
        b = GaugeMetricFamily("pdproxy_backend_breaker_state", "x", labels=["backend"])
        b.add_metric(["d"], self._breaker)
        return [a, b]


def _exposition(requests: int, latencies: list[float], in_flight: float, breaker: float) -> str:
    r = CollectorRegistry()
    c = Counter("pdproxy_requests", "x", ["route"], registry=r)
    c.labels("chat").inc(requests)
    h = Histogram("pdproxy_ttfb_seconds", "x", buckets=(0.1, 1.0), registry=r)
    for v in latencies:
        h.observe(v)
    r.register(_Gauges(in_flight, breaker))  # type: ignore[arg-type]
    return generate_latest(r).decode()


def _values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_counters_histograms_and_load_add_up_states_take_the_worst() -> None:
    merged = _values(
        merge_expositions(
            [_exposition(3, [0.05, 0.5], 2, 0), _exposition(4, [0.05, 5.0], 5, 2)], missing=1
        )
    )
    assert merged[("pdproxy_requests_total", (("route", "chat"),))] == 7
    assert merged[("pdproxy_ttfb_seconds_bucket", (("le", "0.1"),))] == 2
    assert merged[("pdproxy_ttfb_seconds_bucket", (("le", "1.0"),))] == 3
    assert merged[("pdproxy_ttfb_seconds_bucket", (("le", "+Inf"),))] == 4
    assert merged[("pdproxy_ttfb_seconds_count", ())] == 4
    assert merged[("pdproxy_backend_in_flight", (("backend", "d"),))] == 7
    assert merged[("pdproxy_backend_breaker_state", (("backend", "d"),))] == 2
    assert merged[("pdproxy_proxy_processes", ())] == 2
    assert merged[("pdproxy_proxy_processes_unreachable", ())] == 1


def test_one_exposition_comes_back_unchanged_but_for_the_process_count() -> None:
    text = _exposition(3, [0.05], 1, 1)
    merged = _values(merge_expositions([text]))
    own = _values(text.encode())
    assert {k: v for k, v in merged.items() if not k[0].startswith("pdproxy_proxy_")} == own


def test_admission_limits_are_split_over_the_processes_rounding_up() -> None:
    s = ProxySettings(
        admission=AdmissionSettings(max_concurrent=5, queue_size=0, max_connections=4096)
    )
    split = per_process_settings(s, 2).admission
    assert (split.max_concurrent, split.queue_size, split.max_connections) == (3, 0, 2048)
    assert per_process_settings(s, 1) is s
    assert process_count(3) == 3 and process_count(0) >= 1
