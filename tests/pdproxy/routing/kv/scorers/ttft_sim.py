"""A simulated pool for the TTFT scorer's scenario tests: each node a FIFO prefill engine at
its true speed (which the test may change), decisions made by the scorer's view over the cost
model's plan, the legs' timings reported back as the request path would."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.base import RequestOutcome, Role, RouteRequest
from pdproxy.routing.kv.decide import Scoring, decide
from pdproxy.routing.kv.plan import NodeState, Plan, PromptShape
from pdproxy.routing.kv.scorers.base import Ask, Made, Over
from pdproxy.routing.kv.scorers.load import LoadView
from pdproxy.routing.kv.scorers.prefix import PrefixView
from pdproxy.routing.kv.scorers.ttft import TtftScorer
from pdproxy.settings.routing import KvRouterSettings

from ...kv_helpers import Backend


@dataclass
class SimNode:
    ms_per_token: float
    fixed_ms: float = 5.0
    first_step_ms: float = 20.0
    busy_until: float = 0.0
    """Monotonic seconds when its prefill queue empties (the truth, which the router guesses)."""


@dataclass
class Served:
    plan: Plan
    predicted_ms: float | None
    observed_ms: float


@dataclass
class SimPool:
    settings: KvRouterSettings
    nodes: dict[str, SimNode]
    producers: list[str]
    consumers: list[str]
    scorer: TtftScorer = field(init=False)
    now: float = 1000.0

    def __post_init__(self) -> None:
        from prometheus_client import CollectorRegistry

        from pdproxy.routing.kv.scorers.ttft import build

        self.registry = CollectorRegistry()
        self.scorer = build(self.settings, self.registry, clock=lambda: self.now)

    def plan(
        self,
        tokens: int,
        *,
        held: dict[str, int] | None = None,
        ttft_class: str | None = None,
        stream: bool = True,
    ) -> tuple[RouteRequest, Plan, Made, object]:
        bs = self.settings.block_size
        request = RouteRequest(
            uuid.uuid4().hex, "completions", {"prompt": "x", "stream": stream},
            ttft_class=ttft_class,
        )  # fmt: skip
        cands = [Backend(n, Role.PRODUCER) for n in self.producers]
        cands += [Backend(n, Role.CONSUMER) for n in self.consumers]
        view = self.scorer.observe(Ask(request, cands, self.now))
        matches = {NodeId(n): Match(gpu=b, total=b) for n, b in (held or {}).items()}

        def state(name: str) -> NodeState:
            return NodeState(name, matches.get(NodeId(name), Match()))

        w = self.settings.weights
        prompt = PromptShape(tokens, bs)
        scoring = Scoring(
            prompt, [state(p) for p in self.producers], [state(c) for c in self.consumers],
            (LoadView(w), PrefixView(w), view), bs, matches,
        )  # fmt: skip
        plan = decide(scoring, self.settings)
        made = Made(request, plan, prompt, matches, self.now)
        return request, plan, made, view

    def serve(
        self, tokens: int, *, held: dict[str, int] | None = None, ttft_class: str | None = None
    ) -> Served:
        """Route one streamed request now, run it on the simulated engines, report its legs."""
        request, plan, made, view = self.plan(tokens, held=held, ttft_class=ttft_class)
        assert plan.ttft is None or not plan.ttft.shed
        self.scorer.record(made, view)  # type: ignore[arg-type]
        held = held or {}
        bs = self.settings.block_size
        consumer = plan.consumers[0]
        prefill = plan.producers[0] if plan.producers else consumer
        node = self.nodes[prefill]
        cached = min(held.get(prefill, 0) * bs, max(tokens - 1, 0) // bs * bs)
        start = max(self.now, node.busy_until)
        node.busy_until = start + (tokens - cached) * node.ms_per_token / 1e3
        leg_s = node.busy_until - self.now + node.fixed_ms / 1e3
        if plan.producers:
            c = self.nodes[consumer]
            fetch = tokens // bs - held.get(consumer, 0)
            first_s = (c.first_step_ms + 0.05 * max(fetch, 0)) / 1e3
            outcome = RequestOutcome(prefill, consumer, True, producer_s=leg_s,
                                     consumer_first_byte_s=first_s)  # fmt: skip
            observed = leg_s + first_s
        else:
            outcome = RequestOutcome(None, consumer, True, consumer_first_byte_s=leg_s)
            observed = leg_s
        predicted = plan.ttft.way.ttft_ms if plan.ttft and plan.ttft.way else None
        self.scorer.finished(Over(request.request_id, None, tokens // bs), outcome)
        return Served(plan, predicted, observed * 1e3)

    def advance(self, seconds: float) -> None:
        self.now += seconds
