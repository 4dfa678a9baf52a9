"""The KV-aware cost model as pure functions: node states in, a ranked plan out.

Costs are in prefill-token equivalents (see :class:`~pdproxy.routing.kv.settings.CostWeights`):

- producer (or a consumer prefilling alone): the prompt tokens its cache does not cover, after
  tier credit, plus its load;
- consumer in a disaggregated pair: its load plus the blocks it would fetch over P2P.

Then conditional disaggregation (the chosen consumer prefills alone when its uncached suffix is
short or it holds most of the prompt) and the hot-spot guard (a node far more loaded than the least
loaded candidate of its role is ranked after every node within the imbalance bound). Ties break
by name so that every proxy replica given the same state makes the same choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.residency.types import Match
from pdproxy.routing.kv.settings import CostWeights, KvRouterSettings

NO_MATCH = Match()


@dataclass(frozen=True, slots=True)
class PromptShape:
    """How long the prompt is, in tokens and in full blocks."""

    tokens: int
    block_size: int

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_size

    @property
    def max_cacheable_tokens(self) -> int:
        """Engines always compute at least the last prompt token: whole blocks before it."""
        if self.tokens <= 0:
            return 0
        return ((self.tokens - 1) // self.block_size) * self.block_size


@dataclass(frozen=True, slots=True)
class NodeState:
    """One candidate as the router sees it at decision time."""

    name: str
    match: Match = NO_MATCH
    in_flight: int = 0
    queued_tokens: int = 0
    """Prefill tokens routed to the node and not yet finished."""
    engine_load: float = 0.0
    """Engine-reported load beyond this proxy's own requests, in token equivalents
    (:mod:`pdproxy.routing.kv.engine_load_cost`; 0 without a fresh reading)."""


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate's cost and its parts (for the debug header and log)."""

    name: str
    cost: float
    credit_blocks: float
    load: float
    fetch_blocks: int
    in_flight: int
    guarded: bool
    """True when the hot-spot guard ranked the node after the others."""

    def explain(self) -> dict[str, object]:
        return {
            "name": self.name,
            "cost": round(self.cost, 1),
            "credit_blocks": round(self.credit_blocks, 2),
            "load": round(self.load, 1),
            "fetch_blocks": self.fetch_blocks,
            "in_flight": self.in_flight,
            "guarded": self.guarded,
        }


@dataclass(frozen=True, slots=True)
class Plan:
    """The ranked choice. ``producers`` empty: the first consumer serves the request alone."""

    consumers: tuple[str, ...]
    producers: tuple[str, ...]
    reason: str
    predicted_cached_tokens: int
    consumer_scores: tuple[Score, ...]
    producer_scores: tuple[Score, ...]


def credit_blocks(match: Match, weights: CostWeights) -> float:
    """Blocks of prefill a node's cache saves, weighted by the tier that holds them."""
    gpu = match.gpu
    total = max(match.total, gpu)
    predicted = max(match.predicted, total)
    return (
        weights.gpu_credit * gpu
        + weights.host_credit * (total - gpu)
        + weights.predicted_credit * (predicted - total)
    )


def held_blocks(match: Match) -> int:
    """Leading blocks a node holds or is predicted to hold."""
    return max(match.predicted, match.total, match.gpu, match.cpu)


def load_cost(node: NodeState, weights: CostWeights) -> float:
    return (
        weights.in_flight_tokens * node.in_flight
        + weights.queued_token_weight * max(node.queued_tokens, 0)
        + node.engine_load
    )


def prefill_score(node: NodeState, prompt: PromptShape, weights: CostWeights) -> Score:
    """Cost of ``node`` computing the prompt's uncached part itself."""
    credit = min(credit_blocks(node.match, weights), float(prompt.blocks))
    uncached = max(prompt.tokens - credit * prompt.block_size, 0.0)
    load = load_cost(node, weights)
    return Score(node.name, uncached + load, credit, load, 0, node.in_flight, guarded=False)


def consumer_score(node: NodeState, prompt: PromptShape, weights: CostWeights) -> Score:
    """Cost of ``node`` as the consumer of a disaggregated pair: load plus P2P fetch."""
    held = min(held_blocks(node.match), prompt.blocks)
    fetch = prompt.blocks - held
    load = load_cost(node, weights)
    cost = load + fetch * weights.p2p_block_tokens
    return Score(node.name, cost, float(held), load, fetch, node.in_flight, guarded=False)


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


def _hotspot_moved(ranked: Sequence[Score]) -> bool:
    """Whether the guard displaced a cheaper node from first place."""
    return any(s.guarded and s.cost < ranked[0].cost for s in ranked[1:])


def _cached_tokens(blocks: int, prompt: PromptShape) -> int:
    return min(blocks * prompt.block_size, prompt.max_cacheable_tokens)


def plan_route(
    prompt: PromptShape | None,
    producers: Sequence[NodeState],
    consumers: Sequence[NodeState],
    settings: KvRouterSettings,
) -> Plan:
    """Choose and rank consumers and producers.

    ``prompt`` None means the request cannot be hashed (images, embeddings) or the index is
    unavailable: the plan then ranks by load alone. Empty ``producers`` means an aggregated pool:
    the consumers prefill themselves. ``consumers`` must not be empty.
    """
    if not consumers:
        raise ValueError("plan_route needs at least one consumer")
    w = settings.weights
    guard = settings.hotspot_max_imbalance
    shape = prompt if prompt is not None else PromptShape(0, settings.block_size)

    if not producers:
        ranked = rank([prefill_score(c, shape, w) for c in consumers], guard)
        top = ranked[0]
        held = min(held_blocks(_match_of(consumers, top.name)), shape.blocks)
        return Plan(
            consumers=tuple(s.name for s in ranked),
            producers=(),
            reason=_reason(prompt, ranked, held),
            predicted_cached_tokens=_cached_tokens(held, shape),
            consumer_scores=tuple(ranked),
            producer_scores=(),
        )

    c_ranked = rank([consumer_score(c, shape, w) for c in consumers], guard)
    chosen = c_ranked[0]
    c_held = shape.blocks - chosen.fetch_blocks
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

    p_ranked = rank([prefill_score(p, shape, w) for p in producers], guard)
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
    )


def _match_of(nodes: Sequence[NodeState], name: str) -> Match:
    for n in nodes:
        if n.name == name:
            return n.match
    return NO_MATCH


def _reason(prompt: PromptShape | None, ranked: Sequence[Score], held: int) -> str:
    if prompt is None:
        return "load-only"
    if _hotspot_moved(ranked):
        return "hot-spot"
    return "kv-prefix" if held > 0 else "load"
