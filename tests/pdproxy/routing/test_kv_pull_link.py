"""The pull cost's link speed, learned from the workers' pull counters: the parse, the deltas
(resets and hostile values ignored), and end to end a fake backend whose ``/metrics`` counters
grow moves the router's planner toward the measured rate."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from pdproxy.routing.kv.build import build_kv_router
from pdproxy.routing.kv.engine_metrics_text import EngineSample, parse_engine_metrics
from pdproxy.routing.kv.pull_link import PullCounters, PullMeasurement
from pdproxy.routing.kv.router import KvRouter
from pdproxy.routing.kv.scorers.engine_load import EngineLoadScorer
from pdproxy.routing.kv.scorers.pull import PullScorer
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import EngineLoadSettings

from .kv_helpers import BS, SEED
from .test_engine_scrape import FakeBackend, RegisteredBackend, Registry, serving


def worker_page(pull_bytes: str, pull_seconds: str) -> bytes:
    """A reference worker's ``/metrics`` (the lines the router reads)."""
    return (
        b"kvtier_worker_running_requests 1.0\n"
        b"kvtier_worker_waiting_requests 0.0\n"
        b"# TYPE kvtier_worker_pull_bytes counter\n"
        b"kvtier_worker_pull_bytes_total " + pull_bytes.encode() + b"\n"
        b"kvtier_worker_pull_bytes_created 1.7e9\n"
        b"kvtier_worker_pull_seconds_total " + pull_seconds.encode() + b"\n"
    )


def sample(nbytes: float | None, seconds: float | None) -> EngineSample:
    return EngineSample(0, 0, None, nbytes, seconds)


def test_the_parse_reads_both_counters_and_refuses_hostile_values() -> None:
    s = parse_engine_metrics(worker_page("1048576", "0.5"))
    assert s is not None and (s.pull_bytes, s.pull_seconds) == (1048576.0, 0.5)
    for bad in ("-5", "NaN", "+Inf", "1e30", "junk"):
        s = parse_engine_metrics(worker_page(bad, bad))
        assert s is not None and (s.running, s.pull_bytes, s.pull_seconds) == (1, None, None)
    vllm = parse_engine_metrics(b"vllm:num_requests_running 2\n")
    assert vllm is not None and vllm.pull_bytes is None and vllm.pull_seconds is None


def test_deltas_of_growing_counters_and_resets_ignored() -> None:
    c = PullCounters()
    assert c.update("a", sample(1e6, 1.0)) is None  # the first reading is the baseline
    assert c.update("a", sample(3e6, 2.0)) == PullMeasurement(2_000_000, 1.0)
    assert c.update("a", sample(3e6, 2.0)) is None  # no pull since
    assert c.update("a", sample(1e5, 0.1)) is None  # restarted: a new baseline only
    assert c.update("a", sample(5e5, 0.3)) == PullMeasurement(400_000, pytest.approx(0.2))
    assert c.update("a", sample(9e5, 0.3)) is None  # bytes without seconds: not a rate
    assert c.update("a", sample(9e5 + 1e14, 0.3 + 1e-3)) is None  # 1e17 B/s: impossible
    assert c.update("b", sample(None, None)) is None
    assert c.update("a", sample(None, None)) is None  # counters gone: the baseline too
    assert c.nodes() == []
    c.update("a", sample(1.0, 1.0))
    c.forget("a")
    assert c.update("a", sample(2e6, 2.0)) is None


_counter = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))


@given(st.lists(st.tuples(_counter, _counter), max_size=20))
def test_any_sequence_of_readings_yields_only_sane_measurements(
    readings: list[tuple[float | None, float | None]],
) -> None:
    c = PullCounters()
    for nbytes, seconds in readings:
        m = c.update("n", sample(nbytes, seconds))
        if m is not None:
            assert m.nbytes >= 0 and math.isfinite(m.seconds) and m.seconds > 0
            assert m.nbytes / m.seconds <= 1e13 * (1 + 1e-9)


async def wait_for_reading(router: KvRouter, node: str, pull_bytes: float | None) -> None:
    for _ in range(400):
        reading = router.scorer(EngineLoadScorer).readings.latest(node)
        if reading is not None and reading.sample.pull_bytes == pull_bytes:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no reading of {node} with pull_bytes {pull_bytes}")


async def test_scraped_pull_counters_teach_the_planner_the_link_speed() -> None:
    worker = FakeBackend("ok", worker_page("0", "0"))
    async with serving(worker):
        settings = KvRouterSettings(
            model_seed=SEED,
            block_size=BS,
            engine_load=EngineLoadSettings(enabled=True, interval_s=0.05),
        )
        registry = Registry([RegisteredBackend("w0", worker.url)])
        router = build_kv_router(settings, backends=registry, metrics_registry=CollectorRegistry())
        configured = router.scorer(PullScorer).link.bytes_per_s
        assert configured == settings.pull.link_bytes_per_s
        await router.start()
        try:
            await wait_for_reading(router, "w0", 0.0)
            # 200 MB in 0.5 s of pulls: 4e8 B/s, the first measurement is taken whole.
            worker.body = worker_page("200000000", "0.5")
            await wait_for_reading(router, "w0", 2e8)
            assert router.scorer(PullScorer).link.samples == 1
            assert router.scorer(PullScorer).link.bytes_per_s == pytest.approx(4e8)
            gauge = router.metrics.registry.get_sample_value(
                "pdproxy_kv_pull_link_bytes_per_second"
            )
            assert gauge == pytest.approx(4e8)
            # The worker restarts: its counters start over. Only a new baseline.
            worker.body = worker_page("1000000", "0.01")
            await wait_for_reading(router, "w0", 1e6)
            # Hostile or broken values: no reading of the counters, nothing learned.
            for bad in ("-1", "NaN", "1e300"):
                worker.body = worker_page(bad, bad)
                await wait_for_reading(router, "w0", None)
            assert router.scorer(PullScorer).link.samples == 1
            assert router.scorer(PullScorer).link.bytes_per_s == pytest.approx(4e8)
            # Pulls again (after a fresh baseline): 1e9 B/s folds in with ewma_alpha.
            worker.body = worker_page("1000000", "0.01")
            await wait_for_reading(router, "w0", 1e6)
            worker.body = worker_page("1001000000", "1.01")
            await wait_for_reading(router, "w0", 1.001e9)
            alpha = settings.pull.ewma_alpha
            link = router.scorer(PullScorer).link
            assert link.samples == 2
            assert link.bytes_per_s == pytest.approx(alpha * 1e9 + (1 - alpha) * 4e8)
        finally:
            await router.close()
