"""Symmetric pull: the prefix's holder is busy, another node is free; move the KV, not the request.

Given a plan from :func:`~pdproxy.routing.kv.cost.plan_route`, the node that prefills (the
first producer, or the first consumer when it serves alone) is compared, in prefill-token
equivalents, with every way of pulling the prompt's prefix from a node that holds more of it:

- *the plan*: its choice X prefilling the prompt itself (uncached tokens plus load): a
  recompute when X lacks the prefix, a wait when X is the holder;
- *wait* on the holder H: H's own prefill score (shown; its load, or the hot-spot guard, is
  why the plan did not choose it);
- *pull* to a free node Y from H: ``load(Y) + tokens past H's prefix + move(blocks H holds
  that Y lacks) + setup``, where ``move(k) = (bytes H is already sending + k x block_bytes)
  / link speed x prefill speed``: pulls from one holder share its link, so a holder already
  serving pulls is a dearer source.

The cheapest pull wins when it beats the plan's choice by ``min_gain_tokens``. Only nodes the
hot-spot guard did not rank last may be pull targets; only p2p-dialect holders with a
configured ``kv_address`` may be sources (the address comes from configuration, never from a
request). Ties break by name so replicas agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pdproxy.routing.base import PullSource
from pdproxy.routing.kv.cost import NodeState, Plan, PromptShape, Score, load_cost, prefill_score
from pdproxy.routing.kv.load import LoadDelta
from pdproxy.routing.kv.pull_settings import PullSettings
from pdproxy.routing.kv.settings import CostWeights

P2P_DIALECT = "p2p"


@runtime_checkable
class PullEndpoint(Protocol):
    """What a backend must show to take part in a pull (the registry's backends do)."""

    @property
    def name(self) -> str: ...

    @property
    def dialect(self) -> str: ...

    @property
    def kv_address(self) -> tuple[str, int] | None: ...

    @property
    def kv_engine_id(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class PullChoice:
    """A pull the router chose, with the figures that justified it (for the explain header)."""

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
class PulledPlan:
    plan: Plan
    choice: PullChoice
    source: PullSource


def move_tokens(
    blocks: int, settings: PullSettings, link_bytes_per_s: float, queued_bytes: int = 0
) -> float:
    """Cost of moving ``blocks`` over the link behind ``queued_bytes`` the holder is already
    sending, in prefill-token equivalents."""
    seconds = (queued_bytes + blocks * settings.block_bytes) / link_bytes_per_s
    return seconds * settings.prefill_tokens_per_s


def confirmed_blocks(node: NodeState, prompt: PromptShape) -> int:
    """Leading blocks the node holds by events (a prediction is not yet there to be pulled),
    capped where the engine would stop reading cache anyway."""
    held = max(node.match.total, node.match.gpu, node.match.cpu)
    return min(held, prompt.max_cacheable_tokens // prompt.block_size)


def pull_cost(
    target: NodeState,
    prompt: PromptShape,
    *,
    own: int,
    held: int,
    weights: CostWeights,
    settings: PullSettings,
    link_bytes_per_s: float,
    queued_bytes: int = 0,
) -> float:
    rest = max(prompt.tokens - held * prompt.block_size, 0)
    moved = move_tokens(held - own, settings, link_bytes_per_s, queued_bytes)
    return load_cost(target, weights) + rest + moved + settings.setup_tokens


def choose_pull(
    plan: Plan,
    prompt: PromptShape | None,
    producers: Sequence[NodeState],
    consumers: Sequence[NodeState],
    *,
    endpoints: Mapping[str, PullEndpoint],
    weights: CostWeights,
    settings: PullSettings,
    link_bytes_per_s: float,
    sending: Mapping[str, int] | None = None,
) -> PulledPlan | None:
    """The plan rewritten around the best pull, or None when no pull beats it.

    ``endpoints``: the backends that may take part (p2p dialect), by name; a holder also needs
    a ``kv_address``. ``sending``: bytes each holder is already sending to pulls in flight."""
    if not settings.enabled or prompt is None or prompt.blocks == 0:
        return None
    alone = not plan.producers
    role_states = consumers if alone else producers
    ranked = plan.consumer_scores if alone else plan.producer_scores
    chosen = plan.consumers[0] if alone else plan.producers[0]
    by_name = {n.name: n for n in (*producers, *consumers)}
    guarded = {s.name for s in ranked if s.guarded}
    targets = [
        n for n in role_states if n.name not in guarded and _speaks_p2p(endpoints.get(n.name))
    ]
    holders = [
        (n, confirmed_blocks(n, prompt))
        for n in sorted(by_name.values(), key=lambda n: n.name)
        if _can_serve(endpoints.get(n.name))
    ]
    if not targets or not holders:
        return None
    planned = prefill_score(by_name[chosen], prompt, weights).cost
    best: tuple[float, str, str, int, int] | None = None
    for target in targets:
        own = confirmed_blocks(target, prompt)
        for holder, held in holders:
            if holder.name == target.name or held - own < settings.min_blocks:
                continue
            cost = pull_cost(
                target, prompt, own=own, held=held, weights=weights, settings=settings,
                link_bytes_per_s=link_bytes_per_s,
                queued_bytes=(sending or {}).get(holder.name, 0),
            )  # fmt: skip
            key = (cost, target.name, holder.name, own, held)
            if best is None or key < best:
                best = key
    if best is None or best[0] > planned - settings.min_gain_tokens:
        return None
    cost, target_name, holder_name, own, held = best
    endpoint = endpoints[holder_name]
    address = endpoint.kv_address
    assert address is not None  # _can_serve
    blocks = held - own
    choice = PullChoice(
        target=target_name,
        holder=holder_name,
        own_blocks=own,
        holder_blocks=held,
        blocks=blocks,
        nbytes=blocks * settings.block_bytes,
        cost=cost,
        plan_cost=planned,
        wait_cost=prefill_score(by_name[holder_name], prompt, weights).cost,
        link_bytes_per_s=link_bytes_per_s,
    )
    source = PullSource(holder_name, address[0], address[1], endpoint.kv_engine_id, blocks)
    return PulledPlan(_pulled(plan, alone, target_name, held, prompt), choice, source)


def _pulled(plan: Plan, alone: bool, target: str, held: int, prompt: PromptShape) -> Plan:
    """``plan`` with ``target`` first in its prefilling role, reason ``pull``."""
    if alone:
        return dataclasses.replace(
            plan,
            consumers=_first(plan.consumers, target),
            consumer_scores=_first_score(plan.consumer_scores, target),
            reason="pull",
            # The consumer reports pulled blocks as cached, as it does its own.
            predicted_cached_tokens=min(held * prompt.block_size, prompt.max_cacheable_tokens),
        )
    if plan.consumers[0] == target:
        # A "both" node that is the best consumer: it pulls and serves alone.
        return dataclasses.replace(
            plan,
            producers=(),
            reason="pull",
            predicted_cached_tokens=min(held * prompt.block_size, prompt.max_cacheable_tokens),
        )
    return dataclasses.replace(
        plan,
        producers=_first(plan.producers, target),
        producer_scores=_first_score(plan.producer_scores, target),
        reason="pull",
    )


def _first(names: tuple[str, ...], name: str) -> tuple[str, ...]:
    return (name, *(n for n in names if n != name))


def _first_score(scores: tuple[Score, ...], name: str) -> tuple[Score, ...]:
    return tuple(sorted(scores, key=lambda s: s.name != name))


def _speaks_p2p(endpoint: PullEndpoint | None) -> bool:
    return endpoint is not None and str(endpoint.dialect) == P2P_DIALECT


def _can_serve(endpoint: PullEndpoint | None) -> bool:
    return _speaks_p2p(endpoint) and endpoint is not None and endpoint.kv_address is not None


def pull_deltas(
    deltas: Sequence[LoadDelta], pulled: PulledPlan, tokens: int, block_size: int
) -> tuple[LoadDelta, ...]:
    """The decision's charges with the target's queued prefill cut to what it still computes
    after the pull."""
    rest = max(tokens - pulled.choice.holder_blocks * block_size, 0)
    return tuple(
        LoadDelta(d.node, d.in_flight, min(d.queued_tokens, rest))
        if d.node == pulled.choice.target
        else d
        for d in deltas
    )
