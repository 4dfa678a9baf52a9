"""Prefix credit by tier: the prompt's leading blocks a node holds save their prefill.

Term for a node that prefills (:attr:`Task.PREFILL`): the prompt tokens its cache does not
cover, each cached block credited by the tier that holds it (``weights.gpu_credit`` 1.0,
``host_credit`` 0.8: it still has to be copied host → GPU, ``predicted_credit`` 0.9: routed
there, not yet confirmed by events). For the consumer of a disaggregated pair
(:attr:`Task.DECODE`): the blocks it would fetch over P2P, at ``weights.p2p_block_tokens``
each. Residency is what the decision observed, after the other views' ``residency`` and
``credit`` (session affinity, index exactness).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from kvtier.residency.types import Match
from pdproxy.routing.kv.plan import NodeState, PromptShape, Task, Term, held_blocks
from pdproxy.routing.kv.scorers.base import Ask, Scorer, View
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import CostWeights


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


@dataclass(frozen=True, slots=True)
class PrefixView(View):
    weights: CostWeights

    def cost(self, node: NodeState, task: Task, prompt: PromptShape) -> Term:
        if task is Task.PREFILL:
            credit = min(credit_blocks(node.match, self.weights), float(prompt.blocks))
            uncached = max(prompt.tokens - credit * prompt.block_size, 0.0)
            return Term(uncached, credit_blocks=credit)
        held = min(held_blocks(node.match), prompt.blocks)
        fetch = prompt.blocks - held
        return Term(
            fetch * self.weights.p2p_block_tokens, credit_blocks=float(held), fetch_blocks=fetch
        )


class PrefixScorer(Scorer[PrefixView]):
    name = "prefix"

    def __init__(self, weights: CostWeights) -> None:
        self._view = PrefixView(weights)

    def observe(self, ask: Ask) -> PrefixView:
        return self._view


def build(settings: KvRouterSettings, registry: CollectorRegistry) -> PrefixScorer:
    return PrefixScorer(settings.weights)
