"""The learned line: follows a node, forgets slowly, stays bounded."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from pdproxy.routing.kv.latency.fit import SLOPE_CEILING, SLOPE_FLOOR, DecayedFit, Line

SEED = Line(5.0, 0.1, 0)


def test_starts_at_the_seed() -> None:
    fit = DecayedFit(SEED, window=32, max_y=1e5)
    assert fit.line == SEED
    assert fit.line.at(1000) == 105.0


def test_learns_a_line_from_varied_work() -> None:
    fit = DecayedFit(SEED, window=32, max_y=1e5)
    for i in range(60):
        x = 200.0 + 37.0 * (i % 11)
        fit.observe(x, 12.0 + 0.5 * x)
    assert math.isclose(fit.line.slope, 0.5, rel_tol=0.05)
    assert math.isclose(fit.line.intercept, 12.0, rel_tol=0.3, abs_tol=3.0)
    assert fit.line.samples == 60


def test_follows_a_node_whose_speed_changed() -> None:
    fit = DecayedFit(SEED, window=16, max_y=1e5)
    for i in range(40):
        x = 500.0 + 50.0 * (i % 5)
        fit.observe(x, 0.2 * x)
    assert math.isclose(fit.line.at(700), 140.0, rel_tol=0.1)
    for i in range(40):  # three times slower from now on
        x = 500.0 + 50.0 * (i % 5)
        fit.observe(x, 0.6 * x)
    assert math.isclose(fit.line.at(700), 420.0, rel_tol=0.15)


def test_work_all_alike_keeps_the_intercept() -> None:
    fit = DecayedFit(SEED, window=32, max_y=1e5)
    for _ in range(50):
        fit.observe(1000.0, 305.0)
    assert math.isclose(fit.line.at(1000.0), 305.0, rel_tol=0.05)


def test_a_stall_is_clipped_and_nonsense_dropped() -> None:
    fit = DecayedFit(SEED, window=32, max_y=1000.0)
    assert not fit.observe(float("nan"), 5.0)
    assert not fit.observe(100.0, float("inf"))
    fit.observe(100.0, 1e12)
    assert fit.line.at(100.0) <= 1000.0
    assert fit.line.samples == 1


@given(
    st.lists(
        st.tuples(st.floats(-1e6, 1e7, allow_nan=False), st.floats(-1e6, 1e9, allow_nan=False)),
        max_size=50,
    )
)
def test_always_a_sane_line(points: list[tuple[float, float]]) -> None:
    fit = DecayedFit(SEED, window=8, max_y=120_000.0)
    for x, y in points:
        fit.observe(x, y)
        line = fit.line
        assert SLOPE_FLOOR <= line.slope <= SLOPE_CEILING
        assert 0.0 <= line.intercept <= 120_000.0 + 1e-6
        assert math.isfinite(line.at(1e4))


def test_legs_that_waited_are_not_outweighed_by_quiet_ones() -> None:
    """Half the legs wait behind work nobody saw (5x the quiet time): the line sits well above
    the quiet half (weights of 1/observed^2 put it at ~1.16x the quiet legs, a node's best
    case) and not above the mean."""
    fit = DecayedFit(SEED, window=64, max_y=1e5)
    for i in range(400):
        x = 500.0 + 100.0 * (i % 6)
        quiet = 10.0 + 0.05 * x
        fit.observe(x, quiet if i % 2 else 5.0 * quiet)
    quiet = 10.0 + 0.05 * 750.0
    assert 1.5 * quiet <= fit.line.at(750.0) <= 3.0 * quiet


def test_reach_is_the_work_the_line_was_observed_on() -> None:
    fit = DecayedFit(SEED, window=32, max_y=1e5)
    assert fit.reach == 0.0  # the seed: learned on nothing
    for i in range(40):
        x = 100.0 + 20.0 * (i % 5)  # short suffixes: 100-180 tokens
        fit.observe(x, 5.0 + 0.1 * x)
    assert 300.0 < fit.reach < 600.0  # a 2,600-token prompt is an extrapolation
