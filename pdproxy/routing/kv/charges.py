"""What a decision writes to the router state: load charges and predictions.

The chosen consumer is charged one request in flight, and the node that prefills (the producer,
or the consumer alone) the prompt tokens it does not hold. The chosen nodes are predicted to
hold the prompt's blocks past those they are known to hold (by events, or by a live prediction:
siblings of a burst do not rewrite the same entries), so siblings arriving before the KV events
follow the first request.
"""

from __future__ import annotations

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.kv.cost import NO_MATCH, Plan, held_blocks
from pdproxy.routing.kv.explain import HashedPrompt
from pdproxy.routing.kv.load import LoadDelta
from pdproxy.routing.kv.state import Prediction


def load_deltas(
    plan: Plan, hashed: HashedPrompt | str, matches: dict[NodeId, Match], block_size: int
) -> tuple[LoadDelta, ...]:
    tokens = hashed.tokens if isinstance(hashed, HashedPrompt) else 0

    def uncached(node: str) -> int:
        held = held_blocks(matches.get(NodeId(node), NO_MATCH))
        return max(tokens - held * block_size, 0)

    consumer = plan.consumers[0]
    if not plan.producers:
        return (LoadDelta(consumer, 1, uncached(consumer)),)
    producer = plan.producers[0]
    return (LoadDelta(consumer, 1, 0), LoadDelta(producer, 1, uncached(producer)))


def predictions(
    plan: Plan, hashed: HashedPrompt | str, matches: dict[NodeId, Match] | None
) -> list[Prediction]:
    if not isinstance(hashed, HashedPrompt) or matches is None:
        return []
    out: list[Prediction] = []
    for name in (plan.consumers[0], *plan.producers[:1]):
        node = NodeId(name)
        known = held_blocks(matches.get(node, NO_MATCH))
        if known < len(hashed.hashes):
            out.append(Prediction(node, hashed.hashes[known:]))
    return out
