"""The KV router's decision as a pure function of what it observed: score, then pick.

Like Dynamo's ``schedule(overlap, isl)``, :func:`decide` reads a snapshot (the residency and
loads the router observed, the scorers' views) and returns a ranked :class:`Plan`; it awaits
nothing, writes nothing, and gives the same plan for the same snapshot.

1. :func:`scoring_of`: what the decision believes each node holds (the views'
   ``residency``: session affinity), then each candidate as the cost sees it (the views'
   ``credit``: index exactness) with its load.
2. :class:`Scoring`: a candidate's cost for a task is the sum of the views' terms (load,
   engine load, prefix credit or P2P fetch), in the registry's order.
3. :func:`pick`, the picker: cheapest first, ties by name so that every proxy replica given the
   same state makes the same choice; the hot-spot guard ranks a node far more loaded than the
   least loaded candidate of its role after every node within the bound; then conditional
   disaggregation: the chosen consumer prefills alone when its uncached suffix is short or it
   holds most of the prompt, or when it is also the best producer.
4. The views' ``revise`` may rewrite the plan (a pull from a busy holder).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.kv.plan import (
    NO_MATCH,
    NodeState,
    Plan,
    PromptShape,
    Score,
    Task,
    held_blocks,
)
from pdproxy.routing.kv.scorers.base import View, using
from pdproxy.routing.kv.state import NodeLoad, Observation
from pdproxy.settings.routing import KvRouterSettings


@dataclass(frozen=True, slots=True)
class Scoring:
    """The candidates of one decision and the views that score them (implements
    :class:`~pdproxy.routing.kv.scorers.base.Costing`)."""

    prompt: PromptShape | None
    """None: the request cannot be hashed (images, embeddings) or the index is unavailable:
    the plan ranks by load alone."""
    producers: Sequence[NodeState]
    consumers: Sequence[NodeState]
    views: Sequence[View]
    block_size: int
    matches: Mapping[NodeId, Match] = field(default_factory=dict)
    """What the decision believes each node holds (the charges and the explanation read it)."""
    _costs: tuple[View, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_costs", using(self.views, "cost"))

    @property
    def shape(self) -> PromptShape:
        """The prompt, or an empty one when it is unknown (no prefix term then)."""
        return self.prompt if self.prompt is not None else PromptShape(0, self.block_size)

    def score(self, node: NodeState, task: Task) -> Score:
        shape = self.shape
        cost = load = credit = 0.0
        fetch = 0
        for view in self._costs:
            term = view.cost(node, task, shape)
            if term is None:
                continue
            cost += term.tokens
            if term.load:
                load += term.tokens
            credit += term.credit_blocks
            fetch += term.fetch_blocks
        return Score(node.name, cost, credit, load, fetch, node.in_flight, guarded=False)


def scoring_of(
    prompt: PromptShape | None,
    observation: Observation,
    producers: Sequence[str],
    consumers: Sequence[str],
    *,
    views: Sequence[View],
    block_size: int,
) -> Scoring:
    """The named candidates as the views score them, from what the router observed."""
    matches = believed(observation.matches or {}, prompt, views)
    loads = observation.loads
    return Scoring(
        prompt,
        candidates_of(producers, matches, loads, views),
        candidates_of(consumers, matches, loads, views),
        views,
        block_size,
        matches,
    )


def believed(
    matches: Mapping[NodeId, Match], prompt: PromptShape | None, views: Sequence[View]
) -> Mapping[NodeId, Match]:
    """What the decision believes each node holds: the index's matches, then each view's
    ``residency`` (only for a hashed prompt the index answered for)."""
    if prompt is None:
        return matches
    for view in using(views, "residency"):
        matches = view.residency(matches, prompt)
    return matches


def candidates_of(
    names: Sequence[str],
    matches: Mapping[NodeId, Match],
    loads: Mapping[str, NodeLoad],
    views: Sequence[View],
) -> list[NodeState]:
    """Each named candidate as the cost sees it: its match after every view's ``credit``."""
    out = []
    credits = using(views, "credit")
    for name in names:
        load = loads.get(name, NodeLoad())
        match = matches.get(NodeId(name), NO_MATCH)
        for view in credits:
            match = view.credit(name, match)
        out.append(NodeState(name, match, load.in_flight, load.queued_tokens))
    return out


def decide(scoring: Scoring, settings: KvRouterSettings) -> Plan:
    """Pick, then let each view revise the plan."""
    plan = pick(scoring, settings)
    for view in using(scoring.views, "revise"):
        plan = view.revise(plan, scoring)
    return plan


def rank(scores: Sequence[Score], max_imbalance: int) -> list[Score]:
    """Cheapest first; nodes past the hot-spot bound go after all the others."""
    if not scores:
        return []
    least = min(s.in_flight for s in scores)
    marked = [
        Score(
            s.name, s.cost, s.credit_blocks, s.load, s.fetch_blocks, s.in_flight,
            guarded=s.in_flight > least + max_imbalance,
        )
        for s in scores
    ]  # fmt: skip
    return sorted(marked, key=lambda s: (s.guarded, s.cost, s.name))


def pick(scoring: Scoring, settings: KvRouterSettings) -> Plan:
    """Choose and rank consumers and producers. Empty ``producers`` means an aggregated pool:
    the consumers prefill themselves. ``consumers`` must not be empty."""
    prompt, producers, consumers = scoring.prompt, scoring.producers, scoring.consumers
    if not consumers:
        raise ValueError("pick needs at least one consumer")
    guard = settings.hotspot_max_imbalance
    shape = scoring.shape

    if not producers:
        ranked = rank([scoring.score(c, Task.PREFILL) for c in consumers], guard)
        held = min(held_blocks(_match_of(consumers, ranked[0].name)), shape.blocks)
        return Plan(
            consumers=tuple(s.name for s in ranked),
            producers=(),
            reason=_reason(prompt, ranked, held),
            predicted_cached_tokens=_cached_tokens(held, shape),
            consumer_scores=tuple(ranked),
            producer_scores=(),
        )

    c_ranked = rank([scoring.score(c, Task.DECODE) for c in consumers], guard)
    chosen = c_ranked[0]
    c_held = min(held_blocks(_match_of(consumers, chosen.name)), shape.blocks)
    suffix_tokens = shape.tokens - c_held * shape.block_size
    thresholds = settings.local_prefill
    alone_reason = ""
    if prompt is not None and suffix_tokens <= thresholds.max_suffix_tokens:
        alone_reason = "short-suffix"
    elif (
        prompt is not None
        and shape.blocks > 0
        and thresholds.min_hit_ratio < 1.0
        and c_held >= thresholds.min_hit_ratio * shape.blocks
    ):
        alone_reason = "consumer-holds-prefix"
    if alone_reason:
        return Plan(
            consumers=tuple(s.name for s in c_ranked),
            producers=(),
            reason=alone_reason,
            predicted_cached_tokens=_cached_tokens(c_held, shape),
            consumer_scores=tuple(c_ranked),
            producer_scores=(),
        )

    p_ranked = rank([scoring.score(p, Task.PREFILL) for p in producers], guard)
    if p_ranked[0].name == chosen.name:
        # A "both" node that is the best consumer and the best producer: one leg is enough.
        return Plan(
            consumers=tuple(s.name for s in c_ranked),
            producers=(),
            reason="same-node",
            predicted_cached_tokens=_cached_tokens(c_held, shape),
            consumer_scores=tuple(c_ranked),
            producer_scores=tuple(p_ranked),
        )
    p_held = min(held_blocks(_match_of(producers, p_ranked[0].name)), shape.blocks)
    return Plan(
        consumers=tuple(s.name for s in c_ranked),
        producers=tuple(s.name for s in p_ranked),
        reason=_reason(prompt, p_ranked, p_held),
        # The consumer reads its own prefix and fetches every other full block from the producer;
        # vLLM reports the fetched ones as external, not cached.
        predicted_cached_tokens=_cached_tokens(
            c_held if settings.pd_cached_tokens == "consumer_local" else shape.blocks, shape
        ),
        consumer_scores=tuple(c_ranked),
        producer_scores=tuple(p_ranked),
        predicted_producer_cached_tokens=_cached_tokens(p_held, shape),
    )


def _match_of(nodes: Sequence[NodeState], name: str) -> Match:
    for n in nodes:
        if n.name == name:
            return n.match
    return NO_MATCH


def _cached_tokens(blocks: int, prompt: PromptShape) -> int:
    return min(blocks * prompt.block_size, prompt.max_cacheable_tokens)


def _hotspot_moved(ranked: Sequence[Score]) -> bool:
    """Whether the guard displaced a cheaper node from first place."""
    return any(s.guarded and s.cost < ranked[0].cost for s in ranked[1:])


def _reason(prompt: PromptShape | None, ranked: Sequence[Score], held: int) -> str:
    if prompt is None:
        return "load-only"
    if _hotspot_moved(ranked):
        return "hot-spot"
    return "kv-prefix" if held > 0 else "load"
