"""The router's outside signals per node, as one decision sees them: engine-reported load
(:mod:`~pdproxy.routing.kv.engine_load`) and index exactness
(:mod:`~pdproxy.routing.kv.index_exactness`).

For each candidate, :meth:`NodeSignals.adjust` gives the match the cost credits (discounted by
exactness, :func:`discounted_match`) and the engine load term; :meth:`NodeSignals.after_plan`
tells exactness which nodes were just sent blocks they do not hold (events must follow);
:meth:`NodeSignals.annotate` adds both signals to the decision's explain rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.kv.cost import NO_MATCH, Plan, PromptShape
from pdproxy.routing.kv.engine_load import EngineLoadReadings
from pdproxy.routing.kv.engine_load_cost import engine_load_tokens, external_requests
from pdproxy.routing.kv.index_exactness import IndexExactness
from pdproxy.routing.kv.settings import KvRouterSettings


def discounted_match(match: Match, factor: float) -> Match:
    """``match`` with every count scaled by ``factor`` (rounded down), predictions included:
    a prediction waits for events to confirm it, and a node whose events are not arriving can
    neither confirm nor refute one (in the exactness benchmark, keeping them at full credit
    left a silent node's wrong-route rate at 30% instead of about 1%)."""
    if factor >= 1.0:
        return match
    factor = max(factor, 0.0)
    return Match(
        gpu=math.floor(match.gpu * factor),
        cpu=math.floor(match.cpu * factor),
        total=math.floor(match.total * factor),
        predicted=math.floor(match.predicted * factor),
    )


class NodeSignals:
    def __init__(self, settings: KvRouterSettings) -> None:
        engine = settings.engine_load
        self._engine = engine
        self._weights = settings.weights
        self.readings = EngineLoadReadings(engine.interval_s * engine.stale_intervals)
        self.exactness = IndexExactness(settings.index_exactness)

    def adjust(self, node: str, match: Match, now: float) -> tuple[Match, float]:
        """The match the cost credits and the engine load term of ``node``."""
        factor = self.exactness.credit_factor(node, now)
        engine = 0.0
        if self._engine.enabled:
            reading = self.readings.fresh(node, now)
            engine = engine_load_tokens(reading, self._weights, self._engine)
        return discounted_match(match, factor), engine

    def after_plan(
        self,
        plan: Plan,
        prompt: PromptShape | None,
        matches: Mapping[NodeId, Match],
        now: float,
    ) -> None:
        """Nodes sent blocks their confirmed residency lacks must publish events soon."""
        if prompt is None or prompt.blocks == 0:
            return
        chosen = [plan.consumers[0]] if plan.consumers else []
        if plan.producers:
            chosen.append(plan.producers[0])
        for node in chosen:
            if matches.get(NodeId(node), NO_MATCH).total < prompt.blocks:
                self.exactness.expect(node, now)

    def annotate(self, explain: Mapping[str, Any], now: float) -> None:
        """Each candidate row gains its exactness (and event age) and, with engine load on,
        the engine's last reading."""
        for side in ("consumers", "producers"):
            rows = explain.get(side)
            if not isinstance(rows, list):
                continue
            for row in rows:
                name = str(row.get("name"))
                ex = self.exactness.of(name, now)
                row["exactness"] = ex.state.label
                if ex.event_age_s is not None:
                    row["event_age_s"] = round(ex.event_age_s, 1)
                if not self._engine.enabled:
                    continue
                reading = self.readings.latest(name)
                if reading is None:
                    continue
                row["engine"] = {
                    "waiting": reading.sample.waiting,
                    "running": reading.sample.running,
                    "external": external_requests(reading),
                    "age_s": round(reading.age_s(now), 2),
                    "fresh": self.readings.fresh(name, now) is not None,
                }
