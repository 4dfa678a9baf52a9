"""The TTFT scorer in scenarios: cold start, a pool whose speeds change mid-run, PD bypass
choices, shedding order, and what it exports."""

from __future__ import annotations

import statistics

from pdproxy.routing.kv.latency.rates import PoolRates
from pdproxy.settings.routing import KvRouterSettings, LocalPrefillThresholds
from pdproxy.settings.scorers import TtftClass, TtftSettings

from .ttft_sim import SimNode, SimPool

BS = 16


def settings(
    local_prefill: LocalPrefillThresholds | None = None, **ttft: object
) -> KvRouterSettings:
    classes = {
        "interactive": TtftClass(target_ms=600.0),
        "batch": TtftClass(target_ms=6000.0, sheddable=True, yields=True, placement="headroom"),
    }
    return KvRouterSettings(
        block_size=BS,
        ttft=TtftSettings(classes=classes, **ttft),  # type: ignore[arg-type]
        local_prefill=local_prefill or LocalPrefillThresholds(),
    )


def mixed_pool(local_prefill: LocalPrefillThresholds | None = None, **ttft: object) -> SimPool:
    return SimPool(
        settings(local_prefill, **ttft),
        {
            "p-fast": SimNode(0.1),
            "p-slow": SimNode(0.3),
            "c0": SimNode(0.4, first_step_ms=20.0),
            "c1": SimNode(0.4, first_step_ms=40.0),
        },
        ["p-fast", "p-slow"],
        ["c0", "c1"],
    )


def warm_up(pool: SimPool, n: int = 24) -> None:
    for i in range(n):
        pool.serve(512 + 64 * (i % 7))
        pool.advance(0.4)


def test_cold_start_routes_by_the_cost_model_and_learns_from_its_legs() -> None:
    pool = mixed_pool()
    first = pool.serve(1024)
    assert first.plan.ttft is None  # nothing learned: the cost model (and its thresholds)
    assert first.plan.reason in ("load", "kv-prefix")
    short = pool.serve(100)
    assert short.plan.reason == "short-suffix"  # the threshold rule, kept while cold
    warm_up(pool)
    assert pool.scorer.rates.warm
    served = pool.serve(1024)
    assert served.plan.ttft is not None and served.plan.reason.startswith("ttft")


def test_a_new_node_is_read_with_the_pool_speed() -> None:
    s = TtftSettings(warm_samples=2)
    rates = PoolRates(s)
    for x in (500.0, 900.0, 1300.0):
        rates.observe_compute("a", x, 10.0 + 0.2 * x, 0.0)
        rates.observe_compute("b", x, 10.0 + 0.4 * x, 0.0)
    new = rates.snapshot(["c"], 0.0)["c"]
    assert not new.learned
    assert new.compute.slope < 0.25  # the pool's fastest (a), not the configured seed
    cold = PoolRates(s).snapshot(["c"], 0.0)["c"]
    assert cold.compute.slope == s.seed_prefill_ms_per_token


def test_predictions_follow_a_pool_whose_speeds_change_mid_run() -> None:
    pool = mixed_pool()
    warm_up(pool, 40)
    errors, producers = [], []
    for i in range(40):
        served = pool.serve(768 + 32 * (i % 5))
        pool.advance(0.3)
        if served.predicted_ms is not None and i >= 10:
            errors.append(abs(served.predicted_ms - served.observed_ms) / served.observed_ms)
    assert statistics.median(errors) <= 0.2
    # The noisy neighbour moves: the fast producer becomes the slow one, and the other way.
    pool.nodes["p-fast"].ms_per_token, pool.nodes["p-slow"].ms_per_token = 0.3, 0.1
    errors = []
    for i in range(80):
        served = pool.serve(768 + 32 * (i % 5))
        pool.advance(0.3)
        if i >= 40:
            producers.append(served.plan.producers[0] if served.plan.producers else "-")
            assert served.predicted_ms is not None
            errors.append(abs(served.predicted_ms - served.observed_ms) / served.observed_ms)
    assert statistics.median(errors) <= 0.2
    assert producers.count("p-slow") > producers.count("p-fast")  # p-slow is the fast one now
    rates = pool.scorer.rates.exported(pool.now)
    assert rates["p-slow"].compute.slope < rates["p-fast"].compute.slope


def test_bypass_when_the_consumer_holds_the_prefix_and_two_legs_when_the_transfer_pays() -> None:
    pool = mixed_pool()
    warm_up(pool)
    # The prompt's prefix is on c0, the producers are busy: c0 alone is predicted faster.
    pool.nodes["p-fast"].busy_until = pool.nodes["p-slow"].busy_until = pool.now + 2.0
    pool.scorer.rates.queue("p-fast", 20_000, pool.now)
    pool.scorer.rates.queue("p-slow", 6_000, pool.now)
    warm = pool.serve(2048, held={"c0": 120})
    assert warm.plan.reason == "ttft-alone" and warm.plan.consumers[0] == "c0"
    assert not warm.plan.producers
    # A cold long prompt, an idle fast producer, consumers slow to prefill: two legs.
    pool = mixed_pool()
    warm_up(pool)
    pool.advance(2.0)
    cold = pool.serve(2048)
    assert cold.plan.reason == "ttft" and cold.plan.producers[0] == "p-fast"


def test_without_bypass_an_always_disaggregated_pool_stays_disaggregated() -> None:
    """``bypass: false`` leaves the pair-or-alone choice to ``local_prefill`` (here: never
    alone) and ranks only pairs, where bypass would have sent the request to c0 alone."""
    pool = mixed_pool(bypass=False)
    always = LocalPrefillThresholds(max_suffix_tokens=0, min_hit_ratio=1.0)
    pool.settings = pool.settings.model_copy(update={"local_prefill": always})
    warm_up(pool)
    pool.nodes["p-fast"].busy_until = pool.nodes["p-slow"].busy_until = pool.now + 2.0
    pool.scorer.rates.queue("p-fast", 20_000, pool.now)
    pool.scorer.rates.queue("p-slow", 6_000, pool.now)
    served = pool.serve(2048, held={"c0": 120})
    assert served.plan.ttft is not None  # warm: the prediction ranked it
    assert served.plan.reason == "ttft" and served.plan.producers
    assert served.plan.producers[0] == "p-slow"  # the shorter queue of the two


def test_an_always_disaggregated_pool_stays_so_unless_bypass_is_asked_for() -> None:
    """Unset, ``bypass`` follows ``local_prefill``: thresholds that never let a consumer
    prefill alone keep every warm decision a pair; ``bypass: true`` says otherwise."""

    def served_on(pool: SimPool) -> tuple[str, ...]:
        warm_up(pool)
        pool.nodes["p-fast"].busy_until = pool.nodes["p-slow"].busy_until = pool.now + 2.0
        pool.scorer.rates.queue("p-fast", 20_000, pool.now)
        pool.scorer.rates.queue("p-slow", 6_000, pool.now)
        served = pool.serve(2048, held={"c0": 120})
        assert served.plan.ttft is not None and served.plan.reason.startswith("ttft")
        return served.plan.producers

    always = LocalPrefillThresholds(max_suffix_tokens=0, min_hit_ratio=1.0)
    unset = mixed_pool(always)
    assert not unset.scorer.bypass
    assert served_on(unset)[0] == "p-slow"
    asked = mixed_pool(always, bypass=True)
    assert asked.scorer.bypass
    assert served_on(asked) == ()  # c0 alone: the prediction's choice, as asked
    assert mixed_pool().scorer.bypass  # default thresholds: the prediction decides


def test_batch_is_shed_first_and_interactive_never_for_it() -> None:
    pool = mixed_pool()
    warm_up(pool)
    pool.advance(30.0)
    shed_batch = served_interactive = 0
    for _ in range(60):  # a burst far past the pool's capacity
        _, batch, _, _ = pool.plan(1500, ttft_class="batch")
        if batch.ttft is not None and batch.ttft.shed:
            shed_batch += 1
            assert batch.ttft.retry_after_s >= 1
        else:
            pool.serve(1500, ttft_class="batch")
        served = pool.serve(1500, ttft_class="interactive")
        assert served.plan.ttft is not None and not served.plan.ttft.shed
        served_interactive += 1
        pool.advance(0.05)
    assert shed_batch > 0 and served_interactive == 60
    # Batch yields: it was shed while its own target (6 s) was still within reach, to keep the
    # queue short enough for interactive requests.
    _, batch, _, _ = pool.plan(1500, ttft_class="batch")
    assert (batch.ttft is not None and batch.ttft.best.ttft_ms < 6000.0) or batch.ttft.shed


def test_no_target_means_the_lowest_prediction_and_never_shed() -> None:
    pool = mixed_pool()
    warm_up(pool)
    pool.scorer.rates.queue("p-fast", 50_000, pool.now)
    _, plan, _, _ = pool.plan(1024, ttft_class="nonexistent")  # unknown: the default class
    assert plan.ttft is not None and plan.ttft.target.name == "interactive"


def test_exports_rates_per_node_and_the_prediction_error() -> None:
    pool = mixed_pool()
    warm_up(pool)
    r = pool.registry
    assert r.get_sample_value("pdproxy_kv_ttft_prefill_ms_per_token", {"node": "p-fast"})
    assert r.get_sample_value("pdproxy_kv_ttft_samples", {"node": "p-fast", "line": "compute"})
    count = r.get_sample_value(
        "pdproxy_kv_router_ttft_prediction_error_count", {"mode": "pd", "warm": "true"}
    )
    assert count is not None and count > 0


def test_an_unobserved_node_drifts_toward_the_fastest_but_an_idle_pool_does_not() -> None:
    s = TtftSettings(warm_samples=2, relearn_s=10.0)
    rates = PoolRates(s)
    for i, x in enumerate((500.0, 900.0, 1300.0)):
        rates.observe_compute("fast", x, 5.0 + 0.1 * x, float(i))
        rates.observe_compute("slow", x, 5.0 + 0.3 * x, float(i))
    idle = rates.snapshot(["slow"], 1000.0)["slow"]  # nobody observed since: no news
    assert idle.compute.slope > 0.29
    for t in range(10, 40):  # traffic goes on, to "fast" only
        rates.observe_compute("fast", 700.0, 75.0, float(t))
    stale = rates.snapshot(["slow"], 40.0)["slow"]
    assert stale.compute.slope < 0.2  # tried again soon: it may have got faster


def test_the_engines_waiting_queue_floors_the_backlog() -> None:
    """Work other proxies sent (seen only in the engine's scrape) counts as queue ahead."""
    rates = PoolRates(TtftSettings())
    rates.queue("p", 1000, 0.0)
    assert rates.snapshot(["p"], 0.0)["p"].backlog_tokens == 1000
    rates.engine_waiting("p", 10, 0.0)  # ten waiting requests at the mean prefill
    floor = rates.snapshot(["p"], 0.0)["p"].backlog_tokens
    assert floor > 1000
    # Both drain at the node's rate (0.1 ms/token seeded): 0.2 s later 2,000 tokens less.
    assert rates.snapshot(["p"], 0.2)["p"].backlog_tokens == floor - 2000


def test_a_prediction_read_past_the_work_it_was_learned_on_leaves_the_cost_rule_its_choice() -> (
    None
):
    """The cost model (equal loads: by name) would take a-slow; the prediction knows b-fast is
    3x faster on the short prompts it learned from, and moves those. For a prompt far longer
    than any it observed, the lines extrapolate: the cost rule's choice stands."""
    pool = SimPool(
        settings(bypass=False),
        {"a-slow": SimNode(0.3), "b-fast": SimNode(0.1), "c0": SimNode(0.4)},
        ["a-slow", "b-fast"],
        ["c0"],
    )
    for i in range(40):  # longer than local_prefill's short suffix (256): two legs
        pool.serve(384 + 32 * (i % 5))
        pool.advance(0.5)
    short = pool.serve(448)
    assert short.plan.ttft is not None and short.plan.ttft.way is not None
    assert short.plan.producers[0] == "b-fast" and not short.plan.ttft.deferred
    pool.advance(0.5)
    long = pool.serve(1600)  # past ~1,080: twice the observed mean plus two deviations
    assert long.plan.ttft is not None and long.plan.ttft.deferred
    assert long.plan.producers[0] == "a-slow"
    explain = long.plan.ttft.explain()
    assert explain["deferred"] is True
    assert explain["cost"] == {
        "consumer": "c0",
        "producer": "a-slow",
        "ms": explain["chosen"]["ms"],
    }


def test_the_charged_backlog_floors_a_node_whose_burst_was_not_observed_yet() -> None:
    """Twenty requests just went to p-fast and none has finished: its learned backlog may have
    drained, the tokens it was charged have not, and the next request goes elsewhere."""
    from pdproxy.routing.kv.decide import Scoring
    from pdproxy.routing.kv.plan import NodeState, Plan, PromptShape

    pool = mixed_pool(bypass=False)
    warm_up(pool)
    pool.advance(30.0)
    _, plan, _, view = pool.plan(1024)
    assert plan.producers[0] == "p-fast"
    loaded = [NodeState("p-fast", queued_tokens=20 * 1024), NodeState("p-slow")]
    consumers = [NodeState("c0"), NodeState("c1")]
    scoring = Scoring(PromptShape(1024, BS), loaded, consumers, (view,), BS)  # type: ignore[arg-type]
    base = Plan(consumers=("c0", "c1"), producers=("p-fast", "p-slow"), reason="load",
                predicted_cached_tokens=0, consumer_scores=(), producer_scores=())  # fmt: skip
    revised = view.revise(base, scoring)  # type: ignore[attr-defined]
    assert revised.producers[0] == "p-slow"
