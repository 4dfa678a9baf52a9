"""The cost model over constructed states: tiers, load, conditional disaggregation, hot spots."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvtier.residency.types import Match
from pdproxy.routing.kv.plan import NodeState, PromptShape, Task
from pdproxy.routing.kv.scorers.prefix import credit_blocks
from pdproxy.settings.routing import KvRouterSettings, LocalPrefillThresholds
from pdproxy.settings.scorers import CostWeights

from .kv_helpers import plan_route, scoring

S = KvRouterSettings()
LONG = PromptShape(tokens=4096, block_size=16)  # 256 blocks


def gpu(n: int) -> Match:
    return Match(gpu=n, cpu=0, total=n, predicted=n)


def host(n: int) -> Match:
    return Match(gpu=0, cpu=n, total=n, predicted=n)


def test_producer_holding_the_prefix_is_chosen() -> None:
    producers = [NodeState("p0"), NodeState("p1", gpu(200)), NodeState("p2")]
    plan = plan_route(LONG, producers, [NodeState("c0"), NodeState("c1")], S)
    assert plan.producers[0] == "p1"
    assert plan.reason == "kv-prefix"
    # Failover order: the others by cost, ties by name.
    assert plan.producers[1:] == ("p0", "p2")


def test_gpu_tier_beats_host_tier_for_the_same_prefix() -> None:
    producers = [NodeState("host", host(200)), NodeState("gpu", gpu(200))]
    plan = plan_route(LONG, producers, [NodeState("c0")], S)
    assert plan.producers == ("gpu", "host")
    scores = {s.name: s for s in plan.producer_scores}
    # 200 blocks x 16 tokens x (1.0 - 0.8) of extra prefill on the host-tier node.
    assert scores["host"].cost - scores["gpu"].cost == 200 * 16 * 0.2


def test_longer_host_prefix_beats_shorter_gpu_prefix() -> None:
    producers = [NodeState("host", host(250)), NodeState("gpu", gpu(150))]
    plan = plan_route(LONG, producers, [NodeState("c0")], S)
    assert plan.producers[0] == "host"  # 250 x 0.8 = 200 > 150 blocks of credit


def test_prefix_split_across_tiers_gets_mixed_credit() -> None:
    split = Match(gpu=100, cpu=180, total=180, predicted=180)
    assert credit_blocks(split, S.weights) == 100 * 1.0 + 80 * 0.8
    producers = [NodeState("split", split), NodeState("gpu", gpu(160))]
    plan = plan_route(LONG, producers, [NodeState("c0")], S)
    assert plan.producers == ("split", "gpu")  # 164 credit blocks beat 160


def test_predicted_blocks_earn_less_than_confirmed_gpu_blocks() -> None:
    predicted_only = Match(gpu=0, cpu=0, total=0, predicted=100)
    assert credit_blocks(predicted_only, S.weights) == 100 * S.weights.predicted_credit
    producers = [NodeState("pred", predicted_only), NodeState("conf", gpu(100))]
    plan = plan_route(LONG, producers, [NodeState("c0")], S)
    assert plan.producers[0] == "conf"


def test_overloaded_holder_loses_to_idle_node() -> None:
    # The holder saves 64 blocks x 16 = 1024 tokens but has 4096 tokens of prefill queued.
    producers = [NodeState("holder", gpu(64), in_flight=2, queued_tokens=4096), NodeState("idle")]
    plan = plan_route(LONG, producers, [NodeState("c0")], S)
    assert plan.producers[0] == "idle"
    assert plan.reason == "load"


def test_lightly_loaded_holder_still_wins() -> None:
    producers = [NodeState("holder", gpu(200), in_flight=3, queued_tokens=500), NodeState("idle")]
    plan = plan_route(LONG, producers, [NodeState("c0")], S)
    assert plan.producers[0] == "holder"


def test_consumer_choice_counts_p2p_fetch_and_load() -> None:
    consumers = [NodeState("c0", in_flight=1), NodeState("c1", gpu(100), in_flight=1)]
    plan = plan_route(LONG, [NodeState("p0")], consumers, S)
    assert plan.consumers[0] == "c1"
    scores = {s.name: s for s in plan.consumer_scores}
    assert scores["c0"].fetch_blocks == 256 and scores["c1"].fetch_blocks == 156
    # Busy enough, the holder is passed over: fetch savings 100 x 1.6 = 160 < 2 x 128.
    consumers = [NodeState("c0", in_flight=0), NodeState("c1", gpu(100), in_flight=2)]
    assert plan_route(LONG, [NodeState("p0")], consumers, S).consumers[0] == "c0"


def test_short_prompt_goes_to_the_consumer_alone() -> None:
    plan = plan_route(PromptShape(200, 16), [NodeState("p0")], [NodeState("c0")], S)
    assert plan.producers == ()
    assert plan.reason == "short-suffix"


def test_short_uncached_suffix_on_consumer_skips_the_producer() -> None:
    settings = KvRouterSettings(local_prefill=LocalPrefillThresholds(min_hit_ratio=1.0))
    # 4096 tokens; consumer holds 240 blocks = 3840 tokens; suffix 256 ≤ 256.
    plan = plan_route(LONG, [NodeState("p0")], [NodeState("c0", gpu(240))], settings)
    assert plan.producers == () and plan.reason == "short-suffix"
    assert plan.predicted_cached_tokens == 240 * 16
    # One block less: suffix 272 tokens, past the threshold.
    plan = plan_route(LONG, [NodeState("p0")], [NodeState("c0", gpu(239))], settings)
    assert plan.producers == ("p0",)


def test_hit_ratio_threshold_skips_the_producer_for_long_prompts() -> None:
    big = PromptShape(32_768, 16)  # 2048 blocks; suffix of 10 % is 3277 tokens, well past 256
    settings = KvRouterSettings(local_prefill=LocalPrefillThresholds(min_hit_ratio=0.9))
    held = plan_route(big, [NodeState("p0")], [NodeState("c0", gpu(1850))], settings)
    assert held.producers == () and held.reason == "consumer-holds-prefix"
    not_enough = plan_route(big, [NodeState("p0")], [NodeState("c0", gpu(1800))], settings)
    assert not_enough.producers == ("p0",)
    disabled = KvRouterSettings(local_prefill=LocalPrefillThresholds(min_hit_ratio=1.0))
    assert plan_route(big, [NodeState("p0")], [NodeState("c0", gpu(1850))], disabled).producers


def test_pd_predicts_every_full_block_cached_on_consumer() -> None:
    plan = plan_route(LONG, [NodeState("p0")], [NodeState("c0")], S)
    # 4096 tokens, block aligned: the engine computes the last token, so 255 blocks at most.
    assert plan.predicted_cached_tokens == 255 * 16


def test_hot_spot_guard_sends_hot_prefix_elsewhere() -> None:
    settings = KvRouterSettings(
        hotspot_max_imbalance=4, weights=CostWeights(in_flight_tokens=1.0)
    )  # load nearly free: only the guard can move the request
    producers = [NodeState("hot", gpu(250), in_flight=10), NodeState("cool", in_flight=5)]
    plan = plan_route(LONG, producers, [NodeState("c0")], settings)
    assert plan.producers == ("cool", "hot")
    assert plan.reason == "hot-spot"
    assert [s.guarded for s in plan.producer_scores] == [False, True]
    # Within the bound the holder keeps it.
    producers = [NodeState("hot", gpu(250), in_flight=9), NodeState("cool", in_flight=5)]
    plan = plan_route(LONG, producers, [NodeState("c0")], settings)
    assert plan.producers[0] == "hot" and plan.reason == "kv-prefix"


def test_hot_spot_guard_applies_to_consumers() -> None:
    settings = KvRouterSettings(hotspot_max_imbalance=2, weights=CostWeights(in_flight_tokens=0))
    consumers = [NodeState("hot", gpu(100), in_flight=5), NodeState("cool", in_flight=1)]
    plan = plan_route(LONG, [NodeState("p0")], consumers, settings)
    assert plan.consumers == ("cool", "hot")


def test_unhashable_request_routes_by_load_alone() -> None:
    producers = [NodeState("p0", gpu(200), in_flight=3), NodeState("p1", in_flight=1)]
    consumers = [NodeState("c0", in_flight=2), NodeState("c1", in_flight=0)]
    plan = plan_route(None, producers, consumers, S)
    assert plan.producers[0] == "p1" and plan.consumers[0] == "c1"
    assert plan.reason == "load-only"


def test_aggregated_pool_ranks_by_prefill_cost() -> None:
    nodes = [NodeState("a"), NodeState("b", gpu(100)), NodeState("c", host(120))]
    plan = plan_route(LONG, [], nodes, S)
    assert plan.producers == ()
    assert plan.consumers == ("b", "c", "a")  # 100 > 96 credit blocks > 0
    assert plan.predicted_cached_tokens == 1600


def test_both_role_node_best_on_both_sides_serves_alone() -> None:
    node = NodeState("both", gpu(100))
    plan = plan_route(LONG, [node, NodeState("p1")], [node, NodeState("c1")], S)
    assert plan.consumers[0] == "both" and plan.producers == ()
    assert plan.reason == "same-node"


def test_ties_break_by_name_for_replica_agreement() -> None:
    a = plan_route(LONG, [NodeState("p1"), NodeState("p0")], [NodeState("c1"), NodeState("c0")], S)
    b = plan_route(LONG, [NodeState("p0"), NodeState("p1")], [NodeState("c0"), NodeState("c1")], S)
    assert a.producers == b.producers == ("p0", "p1")
    assert a.consumers == b.consumers == ("c0", "c1")


node_states = st.builds(
    NodeState,
    name=st.sampled_from(["n0", "n1", "n2", "n3", "n4"]),
    match=st.builds(
        lambda g, c, extra: Match(gpu=g, cpu=c, total=max(g, c), predicted=max(g, c) + extra),
        st.integers(0, 300),
        st.integers(0, 300),
        st.integers(0, 20),
    ),
    in_flight=st.integers(0, 40),
    queued_tokens=st.integers(0, 10_000),
)


@given(
    tokens=st.integers(0, 6000),
    producers=st.lists(node_states, max_size=5, unique_by=lambda n: n.name),
    consumers=st.lists(node_states, min_size=1, max_size=5, unique_by=lambda n: n.name),
)
def test_plan_invariants(
    tokens: int, producers: list[NodeState], consumers: list[NodeState]
) -> None:
    prompt = PromptShape(tokens, 16)
    plan = plan_route(prompt, producers, consumers, S)
    # Every candidate is ranked exactly once; nothing is invented.
    assert sorted(plan.consumers) == sorted(c.name for c in consumers)
    assert plan.producers == () or sorted(plan.producers) == sorted(p.name for p in producers)
    # Unguarded candidates come first, each group cheapest first.
    for scores in (plan.consumer_scores, plan.producer_scores):
        keys = [(s.guarded, s.cost, s.name) for s in scores]
        assert keys == sorted(keys)
        if scores:
            least = min(s.in_flight for s in scores)
            assert not scores[0].guarded
            assert scores[0].in_flight <= least + S.hotspot_max_imbalance
    assert 0 <= plan.predicted_cached_tokens <= prompt.max_cacheable_tokens
    # Prefill cost never goes below the load and never credits more than the prompt.
    for p in producers:
        score = scoring(prompt, producers, consumers, S).score(p, Task.PREFILL)
        assert score.cost >= score.load
        assert score.credit_blocks <= prompt.blocks
