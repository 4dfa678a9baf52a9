"""Load: the requests and prefill tokens this router (or, with shared state, every replica)
has routed to a node and not yet seen finished.

Term, for any task: ``weights.in_flight_tokens x in_flight + weights.queued_token_weight x
queued_tokens``. The router charges a decision's nodes when it routes and releases them when
the request is over (:mod:`pdproxy.routing.kv.state`); the view reads the counts the decision
observed, so it holds nothing of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdproxy.routing.kv.plan import NodeState, PromptShape, Task, Term
from pdproxy.routing.kv.scorers.base import Ask, Scorer, View
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import CostWeights


@dataclass(frozen=True, slots=True)
class LoadView(View):
    weights: CostWeights

    def cost(self, node: NodeState, task: Task, prompt: PromptShape) -> Term:
        w = self.weights
        tokens = w.in_flight_tokens * node.in_flight + w.queued_token_weight * max(
            node.queued_tokens, 0
        )
        return Term(tokens, load=True)


class LoadScorer(Scorer[LoadView]):
    name = "load"

    def __init__(self, weights: CostWeights) -> None:
        self._view = LoadView(weights)

    def observe(self, ask: Ask) -> LoadView:
        return self._view


def build(settings: KvRouterSettings, registry: CollectorRegistry) -> LoadScorer:
    return LoadScorer(settings.weights)
