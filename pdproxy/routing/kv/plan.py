"""What one KV routing decision talks about (pure data): the prompt's shape, each candidate as
the scorers see it, a scorer's part of a candidate's cost, the candidates' scores, and the
ranked plan.

Costs are in *prefill-token equivalents*: a node's cost estimates the time until the request's
first token in units of the time to prefill one token (see
:class:`~pdproxy.settings.scorers.CostWeights`). Lower is better.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.residency.types import Match
from pdproxy.routing.base import PullSource
from pdproxy.routing.kv.latency.predict import Choice

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


class Task(enum.Enum):
    """What a candidate would do for the request; scorers may charge the two differently."""

    PREFILL = "prefill"
    """Compute the prompt's uncached part: a producer, or a consumer serving alone."""
    DECODE = "decode"
    """The consumer of a disaggregated pair: fetch the prompt's KV over P2P, then decode."""


@dataclass(frozen=True, slots=True)
class NodeState:
    """One candidate as the scorers see it at decision time."""

    name: str
    match: Match = NO_MATCH
    """Leading blocks the cost credits the node with (residency after the views' ``credit``)."""
    in_flight: int = 0
    queued_tokens: int = 0
    """Prefill tokens routed to the node and not yet finished."""


def held_blocks(match: Match) -> int:
    """Leading blocks a node holds or is predicted to hold."""
    return max(match.predicted, match.total, match.gpu, match.cpu)


@dataclass(frozen=True, slots=True)
class Term:
    """One scorer's part of a candidate's cost."""

    tokens: float
    """Prefill-token equivalents added to the cost (>= 0)."""
    load: bool = False
    """Part of the node's load (the explanation's ``load``), rather than of this prompt's work."""
    credit_blocks: float = 0.0
    """Blocks of the prompt this term credits the node with (for the explanation)."""
    fetch_blocks: int = 0
    """Blocks the node would fetch over P2P (for the explanation)."""


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
class PullChoice:
    """A pull the decision chose, with the figures that justified it (for the explain header)."""

    target: str
    holder: str
    own_blocks: int
    """Leading blocks the target already holds (it demands only past them)."""
    holder_blocks: int
    blocks: int
    """Blocks to move: ``holder_blocks - own_blocks``."""
    nbytes: int
    cost: float
    plan_cost: float
    """The plan's choice prefilling the prompt itself: recomputing it on a node that lacks
    the prefix, or waiting on the holder when the plan chose the holder."""
    wait_cost: float
    """The holder prefilling the request itself, after its load."""
    link_bytes_per_s: float
    source: PullSource
    """What the request path sends the node that prefills."""

    def explain(self) -> dict[str, object]:
        return {
            "target": self.target,
            "holder": self.holder,
            "blocks": self.blocks,
            "bytes": self.nbytes,
            "cost": round(self.cost, 1),
            "plan_cost": round(self.plan_cost, 1),
            "wait_cost": round(self.wait_cost, 1),
            "link_mb_per_s": round(self.link_bytes_per_s / 1e6, 1),
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
    pull: PullChoice | None = None
    """The node that prefills pulls the prefix from a holder (:mod:`~.scorers.pull`)."""
    predicted_producer_cached_tokens: int | None = None
    """What the first producer holds of the prompt, in tokens (None: no producer leg)."""
    ttft: Choice | None = None
    """The predicted-TTFT choice that ranked this plan, or shed its request
    (:mod:`~.scorers.ttft`); None: predictions were cold or off, the cost model decided."""
