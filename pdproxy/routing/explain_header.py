"""The opt-in ``x-pdproxy-route`` header: a decision's explanation as compact ASCII JSON."""

from __future__ import annotations

import json
from typing import Any

from pdproxy.routing.base import RouteDecision


def route_explain_value(decision: RouteDecision[Any], max_bytes: int = 4096) -> str:
    """The router's scores when it gave some (truncated to the best candidates when the JSON
    would exceed ``max_bytes``), else just its reason (``{"reason":"round-robin"}``)."""
    if not decision.explain:
        return json.dumps({"reason": decision.reason}, separators=(",", ":"), ensure_ascii=True)
    explain = dict(decision.explain)
    text = json.dumps(explain, separators=(",", ":"), ensure_ascii=True)
    for keep in (3, 1, 0):
        if len(text) <= max_bytes:
            break
        for side in ("consumers", "producers"):
            rows = explain.get(side)
            if isinstance(rows, list):
                explain[side] = rows[:keep]
        text = json.dumps(explain, separators=(",", ":"), ensure_ascii=True)
    return text
