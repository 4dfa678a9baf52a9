"""Engine-reported load: the ``/metrics`` text read (vLLM's and the reference worker's names),
the staleness bound of readings, and the cost term (no double counting of our own requests)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from pdproxy.routing.base import Role
from pdproxy.routing.kv.engine_metrics_text import EngineSample, parse_engine_metrics
from pdproxy.routing.kv.plan import NodeState, PromptShape, Task
from pdproxy.routing.kv.scorers import engine_load
from pdproxy.routing.kv.scorers.base import Ask
from pdproxy.routing.kv.scorers.engine_load import (
    EngineLoadReadings,
    EngineReading,
    engine_load_tokens,
    external_requests,
)
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import CostWeights, EngineLoadSettings

from .kv_helpers import Backend, text_request

WEIGHTS = CostWeights()
ENGINE = EngineLoadSettings(enabled=True)


def vllm_page(waiting: list[int], running: list[int], usage: list[float]) -> bytes:
    """A /metrics page as vLLM writes it: one series per engine (data-parallel rank), plus
    histograms the router must skip."""
    r = CollectorRegistry()
    labels = ["engine", "model_name"]
    w = Gauge("vllm:num_requests_waiting", "waiting", labels, registry=r)
    run = Gauge("vllm:num_requests_running", "running", labels, registry=r)
    kv = Gauge("vllm:kv_cache_usage_perc", "usage", labels, registry=r)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", labels, registry=r)
    for rank, (a, b, c) in enumerate(zip(waiting, running, usage, strict=True)):
        w.labels(str(rank), "m").set(a)
        run.labels(str(rank), "m").set(b)
        kv.labels(str(rank), "m").set(c)
        ttft.labels(str(rank), "m").observe(0.1)
    return generate_latest(r)


def test_vllm_page_sums_ranks_and_takes_the_fullest_cache() -> None:
    sample = parse_engine_metrics(vllm_page([3, 4], [10, 2], [0.5, 0.9]))
    assert sample == EngineSample(waiting=7, running=12, kv_usage=0.9)


def test_reference_worker_names() -> None:
    text = (
        b"# TYPE kvtier_worker_running_requests gauge\n"
        b"kvtier_worker_running_requests 5.0\n"
        b"kvtier_worker_waiting_requests 2.0\n"
        b'kvtier_worker_kv_usage_ratio{group="0"} 0.25\n'
        b'kvtier_worker_kv_usage_ratio{group="1"} 0.75\n'
        b"kvtier_worker_waiting_requests_created 1.7e9\n"
    )
    assert parse_engine_metrics(text) == EngineSample(waiting=2, running=5, kv_usage=0.75)


def test_legacy_vllm_usage_name_and_missing_usage() -> None:
    text = b'vllm:num_requests_waiting{engine="0"} 1\nvllm:gpu_cache_usage_perc{engine="0"} 0.4\n'
    assert parse_engine_metrics(text) == EngineSample(1, 0, 0.4)
    assert parse_engine_metrics(b"vllm:num_requests_running 2\n") == EngineSample(0, 2, None)


def test_hostile_values_are_ignored() -> None:
    text = (
        b"vllm:num_requests_waiting NaN\n"
        b"vllm:num_requests_waiting -5\n"
        b"vllm:num_requests_waiting +Inf\n"
        b"vllm:num_requests_waiting 1e300\n"
        b'vllm:num_requests_running{engine="0"} 3\n'
        b"vllm:kv_cache_usage_perc 7.0\n"
        b'vllm:num_requests_running{engine="1"\n'
        b"vllm:num_requests_running{} notanumber\n"
    )
    assert parse_engine_metrics(text) == EngineSample(0, 3, None)


def test_a_page_without_request_counts_is_no_reading() -> None:
    assert parse_engine_metrics(b"<html>not metrics</html>") is None
    assert parse_engine_metrics(b"vllm:kv_cache_usage_perc 0.5\n") is None
    assert parse_engine_metrics(b"") is None


@settings(deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_parse_without_raising(data: bytes) -> None:
    sample = parse_engine_metrics(data)
    if sample is not None:
        assert sample.waiting >= 0 and sample.running >= 0
        assert sample.kv_usage is None or 0.0 <= sample.kv_usage <= 1.0


def charged(scorer: engine_load.EngineLoadScorer, node: str, now: float) -> float:
    """The engine-load term a decision at ``now`` charges ``node``."""
    view = scorer.observe(Ask(text_request("x"), [Backend(node, Role.CONSUMER)], now))
    return view.cost(NodeState(node), Task.PREFILL, PromptShape(0, 16)).tokens


def reading(waiting: int, running: int, own: int, usage: float | None = None, at: float = 0.0):
    return EngineReading(EngineSample(waiting, running, usage), own, at)


def test_own_requests_are_not_counted_twice() -> None:
    # The engine runs exactly the 4 requests this proxy sent: nothing more to charge.
    assert engine_load_tokens(reading(0, 4, own=4), WEIGHTS, ENGINE) == 0.0
    # 6 more from another client: each costs what one of ours does.
    assert engine_load_tokens(reading(0, 10, own=4), WEIGHTS, ENGINE) == 6 * 128.0
    # Waiting requests are charged on top, whoever sent them.
    assert engine_load_tokens(reading(2, 8, own=4), WEIGHTS, ENGINE) == 6 * 128.0 + 2 * 256.0


def test_kv_usage_is_charged_above_the_knee_only() -> None:
    assert engine_load_tokens(reading(0, 0, 0, usage=0.8), WEIGHTS, ENGINE) == 0.0
    assert engine_load_tokens(reading(0, 0, 0, usage=0.9), WEIGHTS, ENGINE) == 256.0
    assert engine_load_tokens(reading(0, 0, 0, usage=1.0), WEIGHTS, ENGINE) == 512.0


def test_no_reading_charges_nothing() -> None:
    assert engine_load_tokens(None, WEIGHTS, ENGINE) == 0.0


@settings(deadline=None)
@given(
    st.integers(0, 500), st.integers(0, 500), st.integers(0, 1000), st.integers(0, 500),
    st.floats(0.0, 1.0),
)  # fmt: skip
def test_term_is_nonnegative_and_grows_with_the_queue(
    waiting: int, running: int, own: int, more: int, usage: float
) -> None:
    base = engine_load_tokens(reading(waiting, running, own, usage), WEIGHTS, ENGINE)
    assert base >= 0.0
    assert engine_load_tokens(reading(waiting + more, running, own, usage), WEIGHTS, ENGINE) >= base
    assert external_requests(reading(waiting, running, own)) <= waiting + running


def test_a_reading_older_than_the_bound_is_ignored() -> None:
    readings = EngineLoadReadings(max_age_s=3.0)
    readings.put("c0", reading(5, 5, 0, at=100.0))
    assert readings.fresh("c0", 103.0) is not None
    assert readings.fresh("c0", 103.5) is None
    assert readings.latest("c0") is not None  # still shown, no longer charged
    router_settings = KvRouterSettings(engine_load=EngineLoadSettings(enabled=True, interval_s=1.0))
    scorer = engine_load.build(router_settings, CollectorRegistry())
    scorer.readings.put("c0", reading(5, 5, 0, at=100.0))
    assert charged(scorer, "c0", 102.0) > 0.0
    assert charged(scorer, "c0", 104.0) == 0.0  # 3 intervals: own count alone


def test_readings_are_not_charged_when_the_feature_is_off() -> None:
    scorer = engine_load.build(KvRouterSettings(), CollectorRegistry())
    scorer.readings.put("c0", reading(5, 5, 0, at=0.0))
    assert charged(scorer, "c0", 0.0) == 0.0
