"""Symmetric pull: the prefix's holder is busy, another node is free; move the KV, not the request.

Once the picker has ranked the candidates, the node that prefills (the first producer, or the
first consumer when it serves alone) is compared, in prefill-token equivalents, with every way
of pulling the prompt's prefix from a node that holds more of it (:meth:`PullView.revise`):

- *the plan*: its choice X prefilling the prompt itself (uncached tokens plus load): a
  recompute when X lacks the prefix, a wait when X is the holder;
- *wait* on the holder H: H's own prefill cost (shown; its load, or the hot-spot guard, is
  why the plan did not choose it);
- *pull* to a free node Y from H: ``load(Y) + tokens past H's prefix + move(blocks H holds
  that Y lacks) + setup``, where ``move(k) = (bytes H is already sending + k x block_bytes)
  / link speed x prefill speed``: pulls from one holder share its link, so a holder already
  serving pulls is a dearer source.

The cheapest pull wins when it beats the plan's choice by ``min_gain_tokens``. Only nodes the
hot-spot guard did not rank last may be pull targets; only p2p-dialect holders with a
configured ``kv_address`` may be sources (the address comes from configuration, never from a
request). Ties break by name so replicas agree.

The scorer keeps the link speed (:class:`~pdproxy.routing.kv.pull_link.LinkSpeed`: configured,
then measured pulls as the engine-load scrape reports them) and the bytes each holder is
sending to the pulls this replica chose and that are still in flight (from the decision until
the request's ``finished``): they queue ahead of the next pull from that holder. The figure is
this replica's own, even with shared state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdproxy.routing.base import PullSource, RequestOutcome
from pdproxy.routing.kv.plan import NodeState, Plan, PromptShape, PullChoice, Score, Task
from pdproxy.routing.kv.pull_link import LinkSpeed
from pdproxy.routing.kv.scorers.base import Ask, Costing, Made, Over, Scorer, View
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import PullSettings

logger = logging.getLogger(__name__)

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
class _Endpoint:
    """A backend's pull endpoint as one decision saw it."""

    name: str
    dialect: str
    kv_address: tuple[str, int] | None
    kv_engine_id: str | None


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
    target_load: float,
    prompt: PromptShape,
    *,
    own: int,
    held: int,
    settings: PullSettings,
    link_bytes_per_s: float,
    queued_bytes: int = 0,
) -> float:
    """The target's load, the tokens past the holder's prefix, the move and its setup."""
    rest = max(prompt.tokens - held * prompt.block_size, 0)
    moved = move_tokens(held - own, settings, link_bytes_per_s, queued_bytes)
    return target_load + rest + moved + settings.setup_tokens


def choose_pull(
    plan: Plan,
    costing: Costing,
    *,
    endpoints: Mapping[str, PullEndpoint],
    settings: PullSettings,
    link_bytes_per_s: float,
    sending: Mapping[str, int] | None = None,
) -> Plan | None:
    """``plan`` rewritten around the best pull (its ``pull`` set), or None when no pull beats it.

    ``endpoints``: the backends that may take part (p2p dialect), by name; a holder also needs
    a ``kv_address``. ``sending``: bytes each holder is already sending to pulls in flight."""
    prompt = costing.prompt
    if not settings.enabled or prompt is None or prompt.blocks == 0:
        return None
    producers, consumers = costing.producers, costing.consumers
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
    planned = costing.score(by_name[chosen], Task.PREFILL).cost
    best: tuple[float, str, str, int, int] | None = None
    for target in targets:
        own = confirmed_blocks(target, prompt)
        load = costing.score(target, Task.PREFILL).load
        for holder, held in holders:
            if holder.name == target.name or held - own < settings.min_blocks:
                continue
            cost = pull_cost(
                load, prompt, own=own, held=held, settings=settings,
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
        wait_cost=costing.score(by_name[holder_name], Task.PREFILL).cost,
        link_bytes_per_s=link_bytes_per_s,
        source=PullSource(holder_name, address[0], address[1], endpoint.kv_engine_id, blocks),
    )
    return _pulled(plan, alone, choice, prompt)


def _pulled(plan: Plan, alone: bool, choice: PullChoice, prompt: PromptShape) -> Plan:
    """``plan`` with the pull's target first in its prefilling role, reason ``pull``."""
    target, held = choice.target, choice.holder_blocks
    if alone:
        return dataclasses.replace(
            plan,
            consumers=_first(plan.consumers, target),
            consumer_scores=_first_score(plan.consumer_scores, target),
            reason="pull",
            # The consumer reports pulled blocks as cached, as it does its own.
            predicted_cached_tokens=min(held * prompt.block_size, prompt.max_cacheable_tokens),
            pull=choice,
        )
    if plan.consumers[0] == target:
        # A "both" node that is the best consumer: it pulls and serves alone.
        return dataclasses.replace(
            plan,
            producers=(),
            reason="pull",
            predicted_cached_tokens=min(held * prompt.block_size, prompt.max_cacheable_tokens),
            pull=choice,
        )
    return dataclasses.replace(
        plan,
        producers=_first(plan.producers, target),
        producer_scores=_first_score(plan.producer_scores, target),
        reason="pull",
        pull=choice,
    )


def _first(names: tuple[str, ...], name: str) -> tuple[str, ...]:
    return (name, *(n for n in names if n != name))


def _first_score(scores: tuple[Score, ...], name: str) -> tuple[Score, ...]:
    return tuple(sorted(scores, key=lambda s: s.name != name))


def _speaks_p2p(endpoint: PullEndpoint | None) -> bool:
    return endpoint is not None and str(endpoint.dialect) == P2P_DIALECT


def _can_serve(endpoint: PullEndpoint | None) -> bool:
    return _speaks_p2p(endpoint) and endpoint is not None and endpoint.kv_address is not None


@dataclass(frozen=True, slots=True)
class PullView(View):
    settings: PullSettings
    endpoints: Mapping[str, PullEndpoint]
    link_bytes_per_s: float
    sending: Mapping[str, int]

    def revise(self, plan: Plan, costing: Costing) -> Plan:
        pulled = choose_pull(
            plan, costing, endpoints=self.endpoints, settings=self.settings,
            link_bytes_per_s=self.link_bytes_per_s, sending=self.sending,
        )  # fmt: skip
        return plan if pulled is None else pulled


class PullMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pulls = Counter(
            "pdproxy_kv_pulls",
            "Requests routed to a free node that pulls the prompt's prefix from its holder",
            ["holder"],
            registry=registry,
        )
        self.planned_bytes = Counter(
            "pdproxy_kv_pull_planned_bytes",
            "KV bytes the chosen pulls were expected to move (blocks x block_bytes)",
            registry=registry,
        )
        self.measured_bytes = Counter(
            "pdproxy_kv_pull_measured_bytes",
            "KV bytes workers reported pulling (what updates the link speed)",
            registry=registry,
        )
        self.link_speed = Gauge(
            "pdproxy_kv_pull_link_bytes_per_second",
            "Link speed the pull cost uses (configured, then the EWMA of measured pulls)",
            registry=registry,
        )


class PullScorer(Scorer[View]):
    name = "pull"

    def __init__(self, settings: PullSettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.link = LinkSpeed(settings)
        self.metrics = PullMetrics(registry)
        self.metrics.link_speed.set(self.link.bytes_per_s)
        self.sending: dict[str, int] = {}
        """Bytes each holder is sending to pulls in flight, by holder name."""
        self._in_flight: dict[str, tuple[str, int]] = {}
        """Request id -> (holder, bytes) of each pull in flight."""
        self._off = View()

    def observe(self, ask: Ask) -> View:
        if not self.settings.enabled:
            return self._off
        endpoints = {
            b.name: _Endpoint(b.name, str(b.dialect), b.kv_address, b.kv_engine_id)
            for b in ask.candidates
            if isinstance(b, PullEndpoint)
        }
        return PullView(self.settings, endpoints, self.link.bytes_per_s, dict(self.sending))

    def record(self, made: Made, view: View) -> None:
        c = made.plan.pull
        if c is None:
            return
        request_id = made.request.request_id
        self._release(request_id)  # an id reused while in flight: drop its old pull
        self._in_flight[request_id] = (c.holder, c.nbytes)
        self.sending[c.holder] = self.sending.get(c.holder, 0) + c.nbytes
        self.metrics.pulls.labels(c.holder).inc()
        self.metrics.planned_bytes.inc(c.nbytes)
        logger.debug(
            "pull: %s pulls %d blocks (%d bytes) from %s; cost %.0f vs recompute %.0f, "
            "wait %.0f", c.target, c.blocks, c.nbytes, c.holder, c.cost, c.plan_cost,
            c.wait_cost,
        )  # fmt: skip

    def finished(self, over: Over, outcome: RequestOutcome) -> None:
        """The request is over: its pull no longer queues ahead of others."""
        self._release(over.request_id)

    def _release(self, request_id: str) -> None:
        pull = self._in_flight.pop(request_id, None)
        if pull is None:
            return
        holder, nbytes = pull
        left = self.sending.get(holder, 0) - nbytes
        if left > 0:
            self.sending[holder] = left
        else:
            self.sending.pop(holder, None)

    def measured(self, nbytes: int, seconds: float) -> None:
        """A worker measured one pull: ``nbytes`` moved in ``seconds``."""
        if self.link.observe(nbytes, seconds):
            self.metrics.measured_bytes.inc(nbytes)
            self.metrics.link_speed.set(self.link.bytes_per_s)
            logger.debug(
                "pull measured: %d bytes in %.4fs; link estimate %.1f MB/s",
                nbytes, seconds, self.link.bytes_per_s / 1e6,
            )  # fmt: skip


def build(settings: KvRouterSettings, registry: CollectorRegistry) -> PullScorer:
    return PullScorer(settings.pull, registry)
