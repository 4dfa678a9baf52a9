"""The prediction and the choice: pure functions over a snapshot of rates."""

from __future__ import annotations

import pytest

from pdproxy.routing.kv.latency.fit import Line
from pdproxy.routing.kv.latency.predict import Prompt, Target, choose, keep_prefix, ways
from pdproxy.routing.kv.latency.rates import NodeRate

BS = 16


def rate(ms_per_token: float, backlog: float = 0.0, leg: float = 5.0) -> NodeRate:
    return NodeRate(Line(leg, ms_per_token, 10), Line(20.0, 0.05, 10), backlog, True, 0.0, True)


RATES = {
    "p-fast": rate(0.1),
    "p-slow": rate(0.3),
    "c0": rate(0.1),
    "c1": rate(0.1),
}


def test_a_pair_adds_the_prefill_leg_the_transfer_and_the_first_step() -> None:
    prompt = Prompt(1024, BS)
    options = ways(prompt, [("p-fast", 0)], [("c0", 0)], RATES)
    pair = next(w for w in options if w.producer == "p-fast")
    assert pair.ttft_ms == pytest.approx(5.0 + 0.1 * 1024 + 20.0 + 0.05 * 64)
    alone = next(w for w in options if w.alone)
    assert alone.ttft_ms == pytest.approx(5.0 + 0.1 * 1024)


def test_cached_blocks_are_not_prefilled_but_the_last_token_is() -> None:
    prompt = Prompt(1024, BS)
    (alone,) = ways(prompt, [], [("c0", 64)], RATES)
    assert alone.prefill_tokens == 16  # the last block is always computed
    assert alone.ttft_ms == pytest.approx(5.0 + 0.1 * 16)


def test_lowest_prediction_without_a_target_picks_the_fast_producer() -> None:
    prompt = Prompt(4096, BS)
    options = ways(prompt, [("p-fast", 0), ("p-slow", 0)], [("c0", 0)], {
        **RATES, "c0": rate(0.5)})  # fmt: skip
    choice = choose(options, Target("interactive"))
    assert choice.way is not None and choice.way.producer == "p-fast"


def test_bypass_when_the_consumer_holds_the_prefix_and_producers_are_queued() -> None:
    prompt = Prompt(2048, BS)
    rates = {**RATES, "p-fast": rate(0.1, backlog=8000), "p-slow": rate(0.3, backlog=4000)}
    choice = choose(ways(prompt, [("p-fast", 0), ("p-slow", 0)], [("c0", 120)], rates),
                    Target("interactive"))  # fmt: skip
    assert choice.way is not None and choice.way.alone and choice.way.consumer == "c0"


def test_two_legs_when_the_transfer_pays() -> None:
    prompt = Prompt(2048, BS)
    rates = {**RATES, "c0": rate(0.5)}  # a consumer slow to prefill, producers idle
    choice = choose(ways(prompt, [("p-fast", 0)], [("c0", 0)], rates), Target("interactive"))
    assert choice.way is not None and choice.way.producer == "p-fast"


def test_a_sheddable_request_no_way_can_serve_in_time_is_shed_with_retry_after() -> None:
    prompt = Prompt(2048, BS)
    rates = {**RATES, "p-fast": rate(0.1, backlog=30_000), "p-slow": rate(0.3, backlog=30_000),
             "c0": rate(0.1, backlog=30_000)}  # fmt: skip
    options = ways(prompt, [("p-fast", 0), ("p-slow", 0)], [("c0", 0)], rates)
    batch = choose(options, Target("batch", 500.0, sheddable=True))
    assert batch.shed
    assert batch.retry_after_s == 3  # best ~3.2 s, 2.7 s over the target
    interactive = choose(options, Target("interactive", 500.0))
    assert interactive.way is not None and not interactive.met  # never shed: the best way


def test_a_yielding_request_starts_only_where_nothing_queues() -> None:
    prompt = Prompt(2048, BS)
    busy = {**RATES, "p-fast": rate(0.1, backlog=5000), "p-slow": rate(0.3, backlog=2000)}
    # 500 ms and 600 ms queued ahead; the cap is 400 ms: both would well meet batch's 5 s.
    batch = Target("batch", 5000.0, sheddable=True, yields=True, yield_cap_ms=400.0)
    pairs = [w for w in ways(prompt, [("p-fast", 0), ("p-slow", 0)], [("c0", 0)], busy)
             if not w.alone]  # fmt: skip
    choice = choose(pairs, batch)
    assert choice.shed and choice.retry_after_s == 1
    assert choose(pairs, Target("interactive", 5000.0)).way is not None  # never shed
    roomy = {**busy, "p-slow": rate(0.3)}
    pairs = [w for w in ways(prompt, [("p-fast", 0), ("p-slow", 0)], [("c0", 0)], roomy)
             if not w.alone]  # fmt: skip
    choice = choose(pairs, batch)
    assert choice.way is not None and choice.way.producer == "p-slow"


def test_headroom_placement_keeps_the_fast_node_free() -> None:
    prompt = Prompt(1024, BS)
    options = [w for w in ways(prompt, [("p-fast", 0), ("p-slow", 0)], [("c0", 0)], RATES)
               if not w.alone]  # fmt: skip
    fastest = choose(options, Target("x", 1000.0))
    roomy = choose(options, Target("x", 1000.0, placement="headroom"))
    assert fastest.way is not None and fastest.way.producer == "p-fast"
    assert roomy.way is not None and roomy.way.producer == "p-slow"


def test_ties_break_by_name() -> None:
    prompt = Prompt(512, BS)
    options = ways(prompt, [], [("c1", 0), ("c0", 0)], RATES)
    choice = choose(options, Target("interactive"))
    assert choice.way is not None and choice.way.consumer == "c0"


def test_a_node_that_is_both_never_pairs_with_itself() -> None:
    prompt = Prompt(512, BS)
    options = ways(prompt, [("c0", 0)], [("c0", 0)], RATES)
    assert [w.producer for w in options] == [None]


def test_a_near_tie_goes_to_the_node_holding_the_prefix_not_to_exploring() -> None:
    """c1 holds the prompt but is predicted a little slower (within explore_share), and c0 was
    observed longer ago: the holder wins, exploring never trades a prefix for a guess."""
    prompt = Prompt(2048, BS)
    rates = {"c0": rate(0.001, leg=40.0), "c1": rate(0.02, leg=42.0)}
    options = ways(prompt, [], [("c0", 0), ("c1", 120)], rates)
    by = {w.consumer: w for w in options}
    assert by["c0"].ttft_ms < by["c1"].ttft_ms <= by["c0"].ttft_ms * 1.1
    choice = choose(options, Target("interactive", explore_share=0.1))
    assert choice.way is not None and choice.way.consumer == "c1"


def test_a_line_read_past_its_work_is_not_learned_and_a_new_node_explores() -> None:
    short = NodeRate(Line(5.0, 0.1, 10), Line(20.0, 0.05, 10), 0.0, True, 0.0, True, 600.0)
    borrowed = NodeRate(Line(5.0, 0.1, 0), Line(20.0, 0.05, 0), 0.0, False, 0.0, True, 5000.0)
    rates = {"p": short, "c": borrowed}
    for tokens, learned in ((512, True), (4096, False)):
        by = {w.alone: w for w in ways(Prompt(tokens, BS), [("p", 0)], [("c", 0)], rates)}
        assert by[False].learned is learned  # the pair reads p's line
        assert not by[False].explores
        assert by[True].learned and by[True].explores  # c alone: the pool's line, c untried


def test_the_prefix_holder_is_kept_unless_its_queue_costs_more_than_the_error() -> None:
    """c1 holds 120 of the 128 blocks but is predicted slower than c0 recomputing them all
    (noisy rates, a backlog): within the predictions' recent error the holder is kept; past
    it, the holder's queue really costs more and c0 serves."""
    prompt = Prompt(2048, BS)
    rates = {"c0": rate(0.01, leg=40.0), "c1": rate(0.1, backlog=500.0, leg=5.0)}
    options = ways(prompt, [], [("c0", 0), ("c1", 120)], rates)
    by = {w.consumer: w for w in options}
    assert by["c0"].ttft_ms < by["c1"].ttft_ms < by["c0"].ttft_ms * 1.5
    choice = choose(options, Target("interactive", explore_share=0.1))
    assert choice.way is not None and choice.way.consumer == "c0"
    kept = keep_prefix(choice, options, error_share=0.5)
    assert kept.way is not None and kept.way.consumer == "c1" and kept.kept_prefix
    assert kept.explain()["kept_prefix"] is True
    sure = keep_prefix(choice, options, error_share=0.05)
    assert sure.way is not None and sure.way.consumer == "c0" and not sure.kept_prefix
    # A holder that would miss the target is not kept.
    tight = choose(options, Target("interactive", by["c0"].ttft_ms + 1.0, explore_share=0.1))
    assert keep_prefix(tight, options, error_share=0.5).way == by["c0"]


def test_the_error_share_is_the_geometric_mean_miss() -> None:
    from pdproxy.routing.kv.latency.rates import PoolRates
    from pdproxy.settings.scorers import TtftSettings

    rates = PoolRates(TtftSettings())
    assert rates.error_share == pytest.approx(1.0)  # nothing checked yet: off by 2x
    for _ in range(200):
        rates.observe_error(150.0, 100.0)
        rates.observe_error(100.0, 150.0)
    assert rates.error_share == pytest.approx(0.5, rel=0.05)
    rates.observe_error(0.0, 100.0)  # not a prediction: ignored
    assert rates.error_share == pytest.approx(0.5, rel=0.05)
