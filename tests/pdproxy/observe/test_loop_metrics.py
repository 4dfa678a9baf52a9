"""The loop's own counter and histogram expose exactly what prometheus_client's would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdproxy.observe.metrics import LoopCounter, LoopHistogram

_BUCKETS = (0.001, 0.0025, 0.01, 0.5, 1.0, 120.0)
_LABELS = st.sampled_from([("producer", "p0"), ("consumer", "d0"), ("consumer", "d1")])
_AMOUNTS = st.one_of(
    st.sampled_from([0.0, *_BUCKETS]),  # on a bound: the bound's own bucket
    st.floats(min_value=0, max_value=1000, allow_nan=False),
)


def _samples(registry: CollectorRegistry) -> list[tuple[str, str, dict[str, str], float]]:
    """Every sample but the creation times (each instrument has its own clock reading)."""
    return [
        (m.name, m.type, s.labels, s.value)
        for m in registry.collect()
        for s in m.samples
        if not s.name.endswith("_created")
    ]


def _text_without_created(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


@given(st.lists(st.tuples(_LABELS, _AMOUNTS), max_size=40))
def test_histogram_exposes_what_prometheus_client_does(
    observations: list[tuple[tuple[str, str], float]],
) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("leg_seconds", "doc", ["leg", "backend"], buckets=_BUCKETS)
    ours.register(loop)
    reference = Histogram(
        "leg_seconds", "doc", ["leg", "backend"], buckets=_BUCKETS, registry=theirs
    )
    for labels, amount in observations:
        loop.observe(labels, amount)
        reference.labels(*labels).observe(amount)
    assert _samples(ours) == _samples(theirs)
    assert _text_without_created(ours) == _text_without_created(theirs)


@given(st.lists(st.sampled_from(["200", "404", "502"]), max_size=30))
def test_counter_exposes_what_prometheus_client_does(statuses: list[str]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopCounter("requests", "doc", ["route", "status"])
    ours.register(loop)
    reference = Counter("requests", "doc", ["route", "status"], registry=theirs)
    for status in statuses:
        loop.child("chat", status).value += 1
        reference.labels("chat", status).inc()
    assert _samples(ours) == _samples(theirs)
    assert _text_without_created(ours) == _text_without_created(theirs)


def test_created_is_exposed_per_label_set() -> None:
    registry = CollectorRegistry()
    loop = LoopHistogram("leg_seconds", "doc", ["leg"], buckets=_BUCKETS)
    registry.register(loop)
    loop.observe(("producer",), 0.2)
    created = [s for m in registry.collect() for s in m.samples if s.name.endswith("_created")]
    assert [s.labels for s in created] == [{"leg": "producer"}]
    assert created[0].value > 0
