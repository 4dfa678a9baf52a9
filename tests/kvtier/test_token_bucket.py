"""The token bucket shared by P2P handshake admission and worker registration: what a sender
can get past it in any window, whatever it does, and a table that many senders cannot grow."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.token_bucket import TokenBucket, TokenBuckets


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(0.1, 100.0),
    burst=st.floats(1.0, 50.0),
    steps=st.lists(st.tuples(st.floats(-1.0, 2.0), st.booleans()), max_size=200),
)
def test_a_sender_never_gets_more_than_burst_plus_rate_times_the_window(
    rate: float, burst: float, steps: list[tuple[float, bool]]
) -> None:
    bucket = TokenBucket.full(rate, burst, 0.0)
    now = 0.0
    taken = 0
    for dt, give_back in steps:
        now += dt  # the clock may even step back: that refills nothing
        if bucket.take(now):
            taken += 1
            if give_back:  # a legitimate one returns its token
                bucket.give_back()
                taken -= 1
        assert 0.0 <= bucket.tokens <= burst
    elapsed = max(now, 0.0) + sum(-dt for dt, _ in steps if dt < 0)
    assert taken <= burst + rate * elapsed + 1e-9


def test_an_empty_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket.full(2.0, 2.0, 10.0)
    assert bucket.take(10.0) and bucket.take(10.0)
    assert not bucket.take(10.0)
    assert not bucket.take(10.4)  # 0.8 of a token
    assert bucket.take(10.5)


def test_many_senders_cannot_grow_the_table_and_each_keeps_its_own_limit() -> None:
    now = [0.0]
    buckets = TokenBuckets(1.0, 2.0, max_keys=8, clock=lambda: now[0])
    assert buckets.take("victim") and buckets.take("victim")
    assert not buckets.take("victim")  # its own limit, whoever else sends
    for i in range(1000):
        assert buckets.take(f"10.0.{i // 256}.{i % 256}")
        assert len(buckets) <= 8
    buckets.give_back("gone")  # a key no longer tracked: nothing to return, nothing made
    assert len(buckets) <= 8
    now[0] = 1.0
    assert buckets.take("victim")  # forgotten: back full, as any new sender is
    buckets.forget("victim")
    assert len(buckets) <= 8
