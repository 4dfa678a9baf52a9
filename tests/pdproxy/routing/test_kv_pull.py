"""Symmetric pull as a pure decision: when a free node should pull a prefix from its busy
holder instead of recomputing it or waiting for the holder; and the link speed estimate."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvtier.residency.types import Match
from pdproxy.routing.base import RequestOutcome, RouteRequest
from pdproxy.routing.kv.decide import pick
from pdproxy.routing.kv.plan import NodeState, Plan, PromptShape
from pdproxy.routing.kv.pull_link import LinkSpeed
from pdproxy.routing.kv.scorers.base import Ask, Made, Over
from pdproxy.routing.kv.scorers.pull import PullEndpoint, PullScorer, choose_pull, move_tokens
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import PullSettings

from .kv_helpers import scoring

S = KvRouterSettings()
PULL = PullSettings(enabled=True, block_bytes=64 * 1024, link_bytes_per_s=1e9)
LONG = PromptShape(tokens=4096 + 5, block_size=16)  # 256 full blocks, all cacheable


@dataclass(frozen=True)
class Endpoint:
    name: str
    dialect: str = "p2p"
    kv_address: tuple[str, int] | None = ("10.0.0.1", 7100)
    kv_engine_id: str | None = None


def gpu(n: int) -> Match:
    return Match(gpu=n, cpu=0, total=n, predicted=n)


def endpoints(*names: str, **overrides: Endpoint) -> dict[str, PullEndpoint]:
    out: dict[str, PullEndpoint] = {n: Endpoint(n, kv_engine_id=f"engine-{n}") for n in names}
    out.update(overrides)
    return out


def decide(
    producers: list[NodeState],
    consumers: list[NodeState],
    eps: dict[str, PullEndpoint],
    pull: PullSettings = PULL,
    prompt: PromptShape = LONG,
):  # type: ignore[no-untyped-def]
    costing = scoring(prompt, producers, consumers, S)
    plan = pick(costing, S)
    return plan, choose_pull(
        plan, costing, endpoints=eps, settings=pull, link_bytes_per_s=pull.link_bytes_per_s
    )


def consider(
    scorer: PullScorer, request_id: str, consumers: list[NodeState], eps: dict[str, PullEndpoint]
) -> Plan | None:
    """One decision as the router makes it: the scorer's view, the pick, the view's revision,
    the scorer's record; the plan when it pulls."""
    request = RouteRequest(request_id, "completions", {})
    view = scorer.observe(Ask(request, list(eps.values()), 0.0))  # type: ignore[arg-type]
    costing = scoring(LONG, [], consumers, S)
    plan = view.revise(pick(costing, S), costing)
    scorer.record(Made(request, plan, LONG, {}, 0.0), view)
    return plan if plan.pull is not None else None


def finish(scorer: PullScorer, request_id: str) -> None:
    scorer.finished(Over(request_id, None, 0), RequestOutcome(None, None, ok=True))


BUSY_HOLDER = NodeState("a", gpu(256), in_flight=20, queued_tokens=3000)
IDLE = NodeState("b")


def test_busy_holder_idle_node_alone_pool_pulls_to_the_idle_node() -> None:
    plan, pulled = decide([], [BUSY_HOLDER, IDLE], endpoints("a", "b"))
    # Without pull the guard sends the request to b, which recomputes all 4101 tokens.
    assert plan.consumers[0] == "b" and plan.reason == "load"
    assert pulled is not None
    assert pulled.consumers == ("b", "a") and pulled.producers == ()
    assert pulled.reason == "pull"
    assert pulled.predicted_cached_tokens == 4096
    src = pulled.pull.source
    assert (src.holder, src.host, src.port, src.engine_id, src.blocks) == (
        "a", "10.0.0.1", 7100, "engine-a", 256,
    )  # fmt: skip
    c = pulled.pull
    assert c.nbytes == 256 * 64 * 1024
    assert c.cost < c.plan_cost and c.cost < c.wait_cost
    # 5 tokens past the prefix + the move + setup, nothing queued on b.
    assert c.cost == 5 + move_tokens(256, PULL, 1e9) + PULL.setup_tokens


def test_disaggregated_pool_the_free_producer_pulls() -> None:
    holder = NodeState("p0", gpu(256), in_flight=20, queued_tokens=3000)
    plan, pulled = decide([holder, NodeState("p1")], [NodeState("c0")], endpoints("p0", "p1"))
    assert plan.producers[0] == "p1"  # the guard: p1 would recompute
    assert pulled is not None
    assert pulled.producers == ("p1", "p0") and pulled.consumers == ("c0",)
    assert pulled.pull.source.holder == "p0" and pulled.pull.target == "p1"


def test_holder_that_is_the_best_consumer_can_be_the_source_of_a_producer() -> None:
    # c0 holds most of the prompt but not enough to serve alone; the producer that would
    # recompute everything pulls c0's blocks instead.
    consumer = NodeState("c0", gpu(200))
    plan, pulled = decide([NodeState("p0")], [consumer], endpoints("p0", "c0"))
    assert plan.producers == ("p0",)
    assert pulled is not None and pulled.pull.source.holder == "c0" and pulled.pull.blocks == 200


def test_idle_holder_is_waited_for_not_pulled_from() -> None:
    holder = NodeState("a", gpu(256))
    plan, pulled = decide([], [holder, IDLE], endpoints("a", "b"))
    assert plan.consumers[0] == "a" and pulled is None


def test_moderately_busy_holder_still_wins_when_moving_costs_more() -> None:
    # Queue of 300 tokens on the holder; moving 256 blocks over a slow link costs more.
    holder = NodeState("a", gpu(256), in_flight=1, queued_tokens=300)
    slow = PULL.model_copy(update={"link_bytes_per_s": 1e7})  # 10 MB/s
    plan, pulled = decide([], [holder, IDLE], endpoints("a", "b"), slow)
    assert plan.consumers[0] == "a" and pulled is None
    plan, pulled = decide([], [holder, IDLE], endpoints("a", "b"))  # 1 GB/s: move it
    assert pulled is not None and pulled.consumers[0] == "b"


def test_recompute_wins_over_a_pull_on_a_slow_link() -> None:
    slow = PULL.model_copy(update={"link_bytes_per_s": 1e6})
    _, pulled = decide([], [BUSY_HOLDER, IDLE], endpoints("a", "b"), slow)
    assert pulled is None


def test_no_pull_when_disabled_or_unhashable() -> None:
    off = PULL.model_copy(update={"enabled": False})
    assert decide([], [BUSY_HOLDER, IDLE], endpoints("a", "b"), off)[1] is None
    costing = scoring(None, [], [BUSY_HOLDER, IDLE], S)
    eps = endpoints("a", "b")
    unhashable = choose_pull(
        pick(costing, S), costing, endpoints=eps, settings=PULL, link_bytes_per_s=1e9
    )
    assert unhashable is None


def test_holder_without_kv_address_or_p2p_is_never_a_source() -> None:
    no_addr = endpoints("a", "b", a=Endpoint("a", kv_address=None))
    assert decide([], [BUSY_HOLDER, IDLE], no_addr)[1] is None
    nixl = endpoints("a", "b", a=Endpoint("a", dialect="nixl"))
    assert decide([], [BUSY_HOLDER, IDLE], nixl)[1] is None
    nixl_target = endpoints("a", "b", b=Endpoint("b", dialect="nixl"))
    assert decide([], [BUSY_HOLDER, IDLE], nixl_target)[1] is None
    # A backend the router cannot see as a pull endpoint takes no part.
    assert decide([], [BUSY_HOLDER, IDLE], endpoints("b"))[1] is None


def test_a_node_holding_as_much_pulls_nothing() -> None:
    almost = NodeState("b", gpu(254))
    _, pulled = decide([], [BUSY_HOLDER, almost], endpoints("a", "b"))
    assert pulled is None  # 2 blocks < min_blocks; b serves from its own cache


def test_only_confirmed_blocks_are_pulled() -> None:
    predicted_only = NodeState("a", Match(predicted=256), in_flight=20)
    assert decide([], [predicted_only, IDLE], endpoints("a", "b"))[1] is None


def test_the_least_loaded_target_gets_the_pull() -> None:
    busy_b = NodeState("b", in_flight=3)
    idle_c = NodeState("c")
    _, pulled = decide([], [BUSY_HOLDER, busy_b, idle_c], endpoints("a", "b", "c"))
    assert pulled is not None and pulled.consumers[0] == "c"


def test_guarded_nodes_are_never_targets() -> None:
    other_busy = NodeState("b", in_flight=20)
    _, pulled = decide([], [BUSY_HOLDER, other_busy, NodeState("c")], endpoints("a", "b", "c"))
    assert pulled is not None and pulled.pull.target == "c"


nodes = st.builds(
    NodeState,
    name=st.sampled_from(["a", "b", "c", "d"]),
    match=st.integers(0, 300).map(gpu),
    in_flight=st.integers(0, 30),
    queued_tokens=st.integers(0, 5000),
)


@given(
    consumers=st.lists(nodes, min_size=1, max_size=4, unique_by=lambda n: n.name),
    tokens=st.integers(0, 5000),
    link=st.floats(1e5, 1e11),
    no_address=st.sets(st.sampled_from(["a", "b", "c", "d"])),
)
def test_a_chosen_pull_always_pays_for_itself(
    consumers: list[NodeState], tokens: int, link: float, no_address: set[str]
) -> None:
    prompt = PromptShape(tokens, 16)
    settings = PULL.model_copy(update={"link_bytes_per_s": link})
    eps: dict[str, PullEndpoint] = {
        n: Endpoint(n, kv_address=None if n in no_address else ("h", 1)) for n in "abcd"
    }
    plan, pulled = decide([], consumers, eps, settings, prompt)
    if pulled is None:
        return
    c = pulled.pull
    guarded = {s.name for s in plan.consumer_scores if s.guarded}
    assert c.target != c.holder and c.target not in guarded and c.holder not in no_address
    assert c.blocks >= settings.min_blocks
    assert c.holder_blocks * 16 <= prompt.max_cacheable_tokens
    assert c.cost <= c.plan_cost - settings.min_gain_tokens
    assert pulled.consumers[0] == c.target
    assert sorted(pulled.consumers) == sorted(plan.consumers)


def test_link_speed_follows_measured_pulls() -> None:
    settings = PullSettings(link_bytes_per_s=1e9, ewma_alpha=0.5, min_sample_bytes=1000)
    link = LinkSpeed(settings)
    assert link.bytes_per_s == 1e9
    assert not link.observe(999, 1.0)  # too small to say anything about bandwidth
    assert not link.observe(10_000, 0.0)
    assert link.observe(100_000_000, 1.0)  # the first sample replaces the configured value
    assert link.bytes_per_s == 1e8
    assert link.observe(300_000_000, 1.0)
    assert link.bytes_per_s == 2e8


def test_planner_counts_pulls_and_exports_the_link_speed() -> None:
    registry = CollectorRegistry()
    planner = PullScorer(PULL, registry)
    pulled = consider(planner, "r1", [BUSY_HOLDER, IDLE], endpoints("a", "b"))
    assert pulled is not None
    assert registry.get_sample_value("pdproxy_kv_pulls_total", {"holder": "a"}) == 1
    assert registry.get_sample_value("pdproxy_kv_pull_planned_bytes_total") == 256 * 64 * 1024
    assert registry.get_sample_value("pdproxy_kv_pull_link_bytes_per_second") == 1e9
    planner.measured(50_000_000, 0.1)
    assert registry.get_sample_value("pdproxy_kv_pull_link_bytes_per_second") == 5e8
    assert registry.get_sample_value("pdproxy_kv_pull_measured_bytes_total") == 50_000_000


def test_guarded_holder_that_would_still_be_cheapest_is_pulled_from() -> None:
    # 10 requests in flight, nothing queued: cheaper than recomputing, but the hot-spot
    # guard ranks it last. Without pull the request recomputes on b; with pull, b moves it.
    holder = NodeState("a", gpu(256), in_flight=10)
    plan, pulled = decide([], [holder, IDLE], endpoints("a", "b"))
    assert plan.consumers[0] == "b" and plan.reason == "hot-spot"
    assert pulled is not None and pulled.pull.target == "b"
    assert pulled.pull.wait_cost < pulled.pull.plan_cost


def test_pulls_in_flight_from_a_holder_make_it_a_dearer_source() -> None:
    # A slow link: one pull of 256 blocks (16 MiB) costs about 1,700 token equivalents, under
    # the 4,101 of recomputing; two queued ahead of it make a third dearer than recomputing.
    slow = PULL.model_copy(update={"link_bytes_per_s": 8e7})
    planner = PullScorer(slow, CollectorRegistry())
    consumers = [BUSY_HOLDER, IDLE, NodeState("c"), NodeState("d"), NodeState("e")]
    eps = endpoints("a", "b", "c", "d", "e")
    chosen = [consider(planner, f"r{i}", consumers, eps) for i in range(4)]
    assert [p is not None for p in chosen] == [True, True, False, False]
    assert planner.sending == {"a": 2 * 256 * 64 * 1024}
    first, second = chosen[0], chosen[1]
    assert first is not None and second is not None
    assert first.pull is not None and second.pull is not None
    assert second.pull.cost > first.pull.cost  # behind the first one's bytes
    finish(planner, "r0")
    finish(planner, "r0")  # once only
    assert planner.sending == {"a": 256 * 64 * 1024}
    finish(planner, "r1")
    assert planner.sending == {}
    assert consider(planner, "r5", consumers, eps) is not None
