"""The TTFT of each way to serve a request, and the choice against its target (pure).

A way is a (producer, consumer) pair or a consumer alone. Its predicted TTFT in milliseconds::

    pair (P, C):  compute_P(backlog_P + uncached_P)           the prefill leg, behind P's queue
                + fetch_C(blocks C lacks) + ms_per_token_C x backlog_C
                                                              transfer, first step, C's queue
    alone C:      compute_C(backlog_C + uncached_C)

with each node's lines and backlog as :class:`~.rates.NodeRate` (``compute(x) = leg +
ms_per_token x x``, ``fetch(k) = first_step + ms_per_block x k``). ``uncached`` is the prompt's
tokens past the node's cached prefix (engines compute at least the last token).

:func:`choose`: with no target, the lowest prediction. With a target, among the ways that
meet it (and, for a class that yields, find at most ``yield_cap_ms`` queued ahead on the node
that prefills: batch work starts only where interactive work is not queueing), the fastest
(ways within ``explore_share`` of it are ties, won by the way that prefills least, then by the
prefill node observed longest ago, so a node whose speed changed is relearned), or for
``placement="headroom"`` the slowest within ``headroom_share`` of the target (the fast nodes
stay free for others). None meets it: a sheddable request is shed (its ``Retry-After`` is how
far over the best way is), any other gets the lowest prediction.
Ties break by name, so replicas given the same state agree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pdproxy.routing.kv.latency.rates import NodeRate


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: int
    block_size: int

    @property
    def blocks(self) -> int:
        return self.tokens // self.block_size

    def uncached(self, held_blocks: int) -> int:
        """Tokens a node holding ``held_blocks`` leading blocks computes (at least one)."""
        if self.tokens <= 0:
            return 0
        cacheable = ((self.tokens - 1) // self.block_size) * self.block_size
        return self.tokens - min(held_blocks * self.block_size, cacheable)


@dataclass(frozen=True, slots=True)
class Way:
    """One way to serve the request, with its prediction and the figures that learn from it."""

    consumer: str
    producer: str | None
    """None: the consumer alone."""
    ttft_ms: float
    prefill_node: str
    prefill_work: float
    """Tokens ahead on the node that prefills plus the request's own uncached ones."""
    prefill_tokens: int
    """The request's own uncached tokens there (what it adds to that node's backlog)."""
    ahead_ms: float
    """What the prefill node has queued ahead of this request."""
    observed_at: float = 0.0
    """When a leg the prefill node served was last observed (what exploring prefers)."""
    prefill_ms: float = 0.0
    """The prefill leg's part of the prediction (a pair's producer leg; alone: all of it)."""
    fetch_blocks: int = 0
    consumer_queue_ms: float = 0.0
    learned: bool = True
    """Every line it is predicted with was learned (the node's own, or the pool's while the
    node has too few legs) and is read within the work it was observed on: not a seed, not an
    extrapolation."""
    explores: bool = False
    """Its prefill node has no line of its own yet: serving it is how the node is learned."""

    @property
    def alone(self) -> bool:
        return self.producer is None

    def explain(self) -> dict[str, object]:
        return {
            "consumer": self.consumer,
            "producer": self.producer,
            "ms": round(self.ttft_ms, 1),
        }


def alone_way(prompt: Prompt, name: str, held: int, rate: NodeRate) -> Way:
    own = prompt.uncached(held)
    work = rate.backlog_tokens + own
    ms = rate.compute.at(work)
    return Way(
        consumer=name,
        producer=None,
        ttft_ms=ms,
        prefill_ms=ms,
        prefill_node=name,
        prefill_work=work,
        prefill_tokens=own,
        ahead_ms=rate.drain_ms(rate.backlog_tokens),
        observed_at=rate.observed_at,
        learned=work <= rate.compute_reach,
        explores=not rate.learned,
    )


def pair_way(
    prompt: Prompt, producer: tuple[str, int], p: NodeRate, consumer: tuple[str, int], c: NodeRate
) -> Way:
    """``producer`` and ``consumer``: (name, leading blocks it holds)."""
    (producer_name, p_held), (consumer_name, c_held) = producer, consumer
    own = prompt.uncached(p_held)
    work = p.backlog_tokens + own
    fetch = max(prompt.blocks - c_held, 0)
    queue = c.drain_ms(c.backlog_tokens)
    prefill = p.compute.at(work)
    return Way(
        consumer=consumer_name,
        producer=producer_name,
        ttft_ms=prefill + c.fetch.at(fetch) + queue,
        prefill_ms=prefill,
        prefill_node=producer_name,
        prefill_work=work,
        prefill_tokens=own,
        ahead_ms=p.drain_ms(p.backlog_tokens),
        observed_at=p.observed_at,
        fetch_blocks=fetch,
        consumer_queue_ms=queue,
        learned=work <= p.compute_reach and c.fetch_learned,
        explores=not p.learned,
    )


def ways(
    prompt: Prompt,
    producers: Sequence[tuple[str, int]],
    consumers: Sequence[tuple[str, int]],
    rates: Mapping[str, NodeRate],
) -> list[Way]:
    """Every pair and every consumer alone (``(name, held blocks)`` per candidate). A node that
    is both producer and consumer serves alone, never as a pair with itself."""
    out = [alone_way(prompt, c, held, rates[c]) for c, held in consumers]
    for p in producers:
        for c in consumers:
            if p[0] != c[0]:
                out.append(pair_way(prompt, p, rates[p[0]], c, rates[c[0]]))
    return out


@dataclass(frozen=True, slots=True)
class Target:
    """A request's class as the choice reads it."""

    name: str
    target_ms: float | None = None
    sheddable: bool = False
    yields: bool = False
    placement: str = "fastest"
    yield_cap_ms: float | None = None
    """For a class that yields: the most it may find queued ahead on a node (None: no cap)."""
    headroom_share: float = 0.8
    explore_share: float = 0.0
    """Ways within this share of the fastest count as ties (:func:`fastest`)."""


@dataclass(frozen=True, slots=True)
class Choice:
    """The way chosen (None: shed) and why."""

    way: Way | None
    best: Way
    """The lowest prediction (what a shed request would have waited for)."""
    target: Target
    met: bool
    """The chosen way is predicted within the target (True when there is none)."""
    retry_after_s: int = 0
    """Shed: seconds until the best way is predicted to meet the target."""
    node_ms: Mapping[str, float] = field(default_factory=dict)
    """Each candidate's best prediction (for the explanation's rows)."""
    deferred: bool = False
    """The cost model's choice was kept over the prediction's (:func:`defer`)."""
    cost: Way | None = None
    """The cost model's own choice as a way (for the explanation), if it was among them."""
    kept_prefix: bool = False
    """The way holding most of the prompt was kept over a faster-predicted one that would
    recompute it (:func:`keep_prefix`)."""
    error_share: float = 0.0
    """How far off recent predictions were (:attr:`.rates.PoolRates.error_share`)."""

    @property
    def shed(self) -> bool:
        return self.way is None

    def explain(self) -> dict[str, object]:
        out: dict[str, object] = {
            "class": self.target.name,
            "target_ms": self.target.target_ms,
            "best_ms": round(self.best.ttft_ms, 1),
            "met": self.met,
        }
        if self.way is None:
            out["shed"] = True
            out["retry_after_s"] = self.retry_after_s
        else:
            out["chosen"] = self.way.explain()
        if self.cost is not None:
            out["cost"] = self.cost.explain()
        if self.deferred:
            out["deferred"] = True
        if self.kept_prefix:
            out["kept_prefix"] = True
        out["error"] = round(self.error_share, 2)
        return out


def _key(way: Way) -> tuple[float, str, str]:
    return (way.ttft_ms, way.consumer, way.producer or "")


def fastest(options: Sequence[Way], explore_share: float) -> Way:
    """The lowest prediction; ways within ``explore_share`` of it are ties. A tie goes to the
    way that prefills the fewest tokens (its node holds most of the prompt), then to the prefill
    node observed longest ago: a node believed slow is only relearned when it is sent work, and
    near-ties are where trying it costs least, but a prefix a node holds is never traded for a
    guess (exploring among near-ties once spread a conversation's turns over every node, and
    each one recomputed what the last one held)."""
    best = min(options, key=_key)
    near = best.ttft_ms * (1.0 + explore_share)
    tied = [w for w in options if w.ttft_ms <= near]
    least = min(w.prefill_tokens for w in tied)
    return min(
        (w for w in tied if w.prefill_tokens == least), key=lambda w: (w.observed_at, *_key(w))
    )


def choose(options: Sequence[Way], target: Target) -> Choice:
    """The way for a request of ``target``'s class (``options`` must not be empty)."""
    best = min(options, key=_key)
    limit = target.target_ms
    if limit is None:
        return Choice(fastest(options, target.explore_share), best, target, True)
    cap = target.yield_cap_ms if target.yields else None
    fits = [w for w in options if w.ttft_ms <= limit and (cap is None or w.ahead_ms <= cap)]
    if fits:
        if target.placement == "headroom":
            roomy = [w for w in fits if w.ttft_ms <= limit * target.headroom_share]
            if roomy:
                return Choice(max(roomy, key=_key), best, target, True)
        return Choice(fastest(fits, target.explore_share), best, target, True)
    if target.sheddable:
        over_ms = best.ttft_ms - limit
        if cap is not None:
            over_ms = max(over_ms, min(w.ahead_ms for w in options) - cap)
        return Choice(None, best, target, False, max(1, math.ceil(over_ms / 1e3)))
    return Choice(best, best, target, False)


def defer(choice: Choice, cost: Way | None) -> Choice:
    """Keep the cost model's own way (``cost``) over the prediction's when the prediction has
    not earned the change: its way is the lowest prediction (not a tie it broke: a prefix held,
    a node relearned), it does not try a node nothing is known of yet (optimistic on purpose:
    that is how a node is learned), and either its line is read past the work it was learned
    on (a consumer that prefilled only short suffixes alone, read for a whole prompt: predicted
    22 ms, it took 212), or it beats ``cost`` by no more than ``explore_share`` (a near-tie is
    noise). ``cost`` must itself serve the class (meet its target)."""
    way = choice.way
    if way is None or cost is None or cost == way or way != choice.best or way.explores:
        return choice
    target = choice.target
    if way.learned and cost.ttft_ms > way.ttft_ms * (1.0 + target.explore_share):
        return choice
    if not choose([cost], target).met:
        return choice
    return dataclasses.replace(choice, way=cost, deferred=True)


def keep_prefix(choice: Choice, options: Sequence[Way], error_share: float) -> Choice:
    """The way that prefills least (its node holds most of the prompt) over the chosen one
    that would recompute part of it, unless the holder is predicted slower by more than the
    predictions' recent error (or ``explore_share``): its queue must really cost more. The
    holder must itself serve the class. Between identical nodes on a busy machine the learned
    rates differed 20x: a node predicted 85 ms for a whole prompt won over the holder of 180
    of its 190 blocks predicted 110 ms, and the pool recomputed half again what it had to."""
    way = choice.way
    if way is None:
        return choice
    least = min(w.prefill_tokens for w in options)
    if way.prefill_tokens <= least:
        return choice
    holder = min((w for w in options if w.prefill_tokens == least), key=_key)
    band = max(error_share, choice.target.explore_share)
    if holder.ttft_ms > way.ttft_ms * (1.0 + band) or not choose([holder], choice.target).met:
        return choice
    return dataclasses.replace(choice, way=holder, kept_prefix=True)
