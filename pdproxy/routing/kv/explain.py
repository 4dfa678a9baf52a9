"""A plan turned into the request path's :class:`RouteDecision`, with its explanation.

``explain`` is what the opt-in debug header (:mod:`pdproxy.routing.explain_header`) and the
debug log line show: the reason, where the residency came from (``memory``, ``redis`` or
``fallback``), the decision time, per candidate its cost, its parts and its matched blocks per
tier and its best predicted TTFT (the scorers then add their own figures,
:meth:`Scorer.annotate`), a pull's figures, and the TTFT choice (class, target, best, chosen).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.base import B, RouteDecision
from pdproxy.routing.kv.plan import NO_MATCH, Plan, Score
from pdproxy.routing.kv.prompt_hash import HashedPrompt


def _rows(
    scores: Sequence[Score], matches: Mapping[NodeId, Match], ttft_ms: Mapping[str, float]
) -> list[dict[str, object]]:
    out = []
    for s in scores:
        row = s.explain()
        m = matches.get(NodeId(s.name), NO_MATCH)
        row.update(gpu=m.gpu, cpu=m.cpu, total=m.total, predicted=m.predicted)
        ms = ttft_ms.get(s.name)
        if ms is not None:
            row["ttft_ms"] = round(ms, 1)
        out.append(row)
    return out


def decision_of(
    plan: Plan,
    *,
    request_id: str,
    prods: Sequence[B],
    cons: Sequence[B],
    hashed: HashedPrompt | str,
    matches: Mapping[NodeId, Match],
    source: str,
    decided_s: float,
    route_s: float,
) -> RouteDecision[B]:
    """``hashed`` is the prompt's hashes, or why it could not be hashed; the decision ranks
    the very objects given in ``prods`` and ``cons``."""
    by_p = {b.name: b for b in prods}
    by_c = {b.name: b for b in cons}
    node_ms = plan.ttft.node_ms if plan.ttft is not None else {}
    explain: dict[str, Any] = {
        "reason": plan.reason,
        "index": source,
        "decide_ms": round(decided_s * 1e3, 3),
        "consumers": _rows(plan.consumer_scores, matches, node_ms),
        "producers": _rows(plan.producer_scores, matches, node_ms),
    }
    if plan.ttft is not None:
        explain["ttft"] = plan.ttft.explain()
    if isinstance(hashed, HashedPrompt):
        explain.update(prompt_tokens=hashed.tokens, blocks=len(hashed.hashes))
        explain["predicted_cached_tokens"] = plan.predicted_cached_tokens
        if plan.predicted_producer_cached_tokens is not None:
            explain["predicted_producer_cached_tokens"] = plan.predicted_producer_cached_tokens
    else:
        explain["unhashable"] = hashed
    if plan.pull is not None:
        explain["pull"] = plan.pull.explain()
    load_only = plan.reason == "load-only"
    return RouteDecision(
        request_id=request_id,
        consumers=[by_c[n] for n in plan.consumers],
        producers=[by_p[n] for n in plan.producers],
        reason=plan.reason,
        explain=explain,
        predicted_cached_tokens=None if load_only else plan.predicted_cached_tokens,
        predicted_producer_cached_tokens=None
        if load_only
        else plan.predicted_producer_cached_tokens,
        prompt_tokens=hashed.tokens if isinstance(hashed, HashedPrompt) else None,
        route_time_s=route_s,
        pull=plan.pull.source if plan.pull is not None else None,
    )
