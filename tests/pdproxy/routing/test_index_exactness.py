"""The per-node index exactness state machine: scenarios and invariants (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.residency.types import Match
from pdproxy.routing.kv.scorers.index_exactness import (
    Exactness,
    IndexExactness,
    discounted_match,
)
from pdproxy.settings.scorers import IndexExactnessSettings

SETTINGS = IndexExactnessSettings(silence_s=5.0, settle_s=2.0)


def tracker() -> IndexExactness:
    ex = IndexExactness(SETTINGS)
    ex.track("a", 0.0)
    return ex


def test_in_sequence_stream_is_exact_with_its_age() -> None:
    ex = tracker()
    ex.delivered("a", 0, 1.0)
    ex.delivered("a", 1, 2.0)
    state = ex.of("a", 3.5)
    assert state.state is Exactness.EXACT and state.event_age_s == 1.5


def test_gap_is_degraded_until_the_replay_reaches_the_revealing_batch() -> None:
    ex = tracker()
    ex.delivered("a", 0, 1.0)
    ex.gap("a", 5, 2.0)  # live batch 5 arrived, 1..4 missing
    assert ex.of("a", 2.0).state is Exactness.DEGRADED
    assert ex.credit_factor("a", 2.0) == SETTINGS.degraded_credit
    for seq in (1, 2, 3, 4):
        ex.delivered("a", seq, 2.1)
        assert ex.of("a", 2.1).state is Exactness.DEGRADED
    ex.delivered("a", 5, 2.2)
    assert ex.of("a", 2.2).state is Exactness.EXACT


def test_gap_whose_replay_fails_is_stale_until_settled() -> None:
    ex = tracker()
    ex.gap("a", 5, 1.0)
    ex.lost("a", 1.5)
    assert ex.of("a", 1.5).state is Exactness.STALE
    assert ex.credit_factor("a", 1.5) == SETTINGS.stale_credit
    ex.delivered("a", 5, 2.0)  # the stream goes on, but too soon after the loss
    assert ex.of("a", 2.0).state is Exactness.STALE
    ex.delivered("a", 6, 3.6)
    assert ex.of("a", 3.6).state is Exactness.EXACT


def test_disconnect_is_degraded_until_the_reset_that_follows() -> None:
    ex = tracker()
    ex.gap("a", None, 1.0)
    ex.delivered("a", 3, 1.1)  # a batch alone does not prove nothing was lost
    assert ex.of("a", 1.1).state is Exactness.DEGRADED
    ex.lost("a", 1.2)
    assert ex.of("a", 1.2).reason == "lost"


def test_idle_node_is_never_stale() -> None:
    ex = tracker()
    ex.delivered("a", 0, 0.0)
    assert ex.of("a", 1000.0).state is Exactness.EXACT


def test_silence_after_work_is_stale_and_a_late_batch_clears_it() -> None:
    ex = tracker()
    ex.expect("a", 10.0)
    ex.expect("a", 12.0)  # the first expectation counts
    assert ex.of("a", 14.9).state is Exactness.EXACT
    state = ex.of("a", 15.0)
    assert state.state is Exactness.STALE and state.reason == "silent"
    ex.delivered("a", 0, 20.0)
    assert ex.of("a", 20.0).state is Exactness.EXACT
    assert ex.of("a", 40.0).state is Exactness.EXACT  # no work sent since


def test_untracked_nodes_are_exact_and_disabled_discount_is_full_credit() -> None:
    ex = IndexExactness(IndexExactnessSettings(enabled=False))
    ex.track("a", 0.0)
    ex.lost("a", 0.0)
    assert ex.of("a", 0.0).state is Exactness.STALE
    assert ex.credit_factor("a", 0.0) == 1.0
    assert ex.of("b", 0.0).state is Exactness.EXACT
    ex.delivered("b", 0, 0.0)  # events of a node no longer followed are ignored
    assert ex.nodes() == ["a"]


def test_discounted_match_scales_every_tier_and_predictions() -> None:
    m = Match(gpu=8, cpu=4, total=10, predicted=15)
    assert discounted_match(m, 1.0) is m
    assert discounted_match(m, 0.5) == Match(gpu=4, cpu=2, total=5, predicted=7)
    assert discounted_match(m, 0.0) == Match()


@settings(deadline=None)
@given(st.integers(0, 100), st.integers(0, 100), st.integers(0, 100), st.floats(0.0, 1.0))
def test_discount_keeps_the_match_ordering(gpu: int, cpu: int, extra: int, f: float) -> None:
    total = max(gpu, cpu) + extra // 2
    m = discounted_match(Match(gpu, cpu, total, total + extra), f)
    assert m.predicted >= m.total >= max(m.gpu, m.cpu)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["delivered", "gap", "gap-disconnect", "lost", "expect", "read"]),
        st.integers(0, 20),
        st.floats(0.0, 3.0),
    ),
    max_size=60,
)


@settings(deadline=None)
@given(OPS)
def test_invariants_over_any_event_history(ops: list[tuple[str, int, float]]) -> None:
    ex = tracker()
    now = 0.0
    last_lost: float | None = None
    forgiven = True
    for op, seq, dt in ops:
        now += dt
        before = ex.of("a", now)
        if op == "delivered":
            ex.delivered("a", seq, now)
            if last_lost is not None and now - last_lost >= SETTINGS.settle_s:
                forgiven = True
            after = ex.of("a", now)
            assert after.event_age_s == 0.0
            if before.state is Exactness.EXACT:
                assert after.state is Exactness.EXACT  # in-sequence batches never degrade
        elif op == "gap":
            ex.gap("a", seq, now)
            assert ex.of("a", now).state is not Exactness.EXACT
        elif op == "gap-disconnect":
            ex.gap("a", None, now)
            assert ex.of("a", now).state is not Exactness.EXACT
        elif op == "lost":
            ex.lost("a", now)
            last_lost = now
            forgiven = False
            assert ex.of("a", now).state is Exactness.STALE
        elif op == "expect":
            ex.expect("a", now)
        state = ex.of("a", now)
        assert 0.0 <= ex.credit_factor("a", now) <= 1.0
        assert state.event_age_s is None or state.event_age_s >= 0.0
        if state.state is Exactness.EXACT:
            # a loss is forgiven only by a batch delivered at least settle_s after it
            assert forgiven
