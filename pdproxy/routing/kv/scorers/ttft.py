"""Predicted time to first token: route to the lowest prediction meeting the request's target,
bypass the producer when the consumer alone is faster, shed what no candidate can serve in time.

The model is :mod:`pdproxy.routing.kv.latency` (rates learned per node, the prediction a pure
function); this module plugs it into the router's hooks:

- observe: each candidate's rates (:meth:`PoolRates.snapshot`) and the request's class
  (``RouteRequest.ttft_class``, the key's; ``ttft_target_ms``, a trusted caller's own target);
- revise (:meth:`TtftView.revise`, pure): once the pool is warm, every way to serve the request
  (each pair, each consumer alone) is predicted and :func:`~.latency.predict.choose` picks; the
  plan is re-ranked with the chosen way first. Cold (no node has ``warm_samples`` observed
  legs): the plan stays the cost model's, thresholds included, and its legs teach the rates;
- record: the chosen way's prefill tokens join that node's backlog; what the way predicted is
  kept until the request is over;
- finished: the observed legs (``RequestOutcome.producer_s``, ``consumer_first_byte_s``) teach
  the nodes' rates, and a stream's observed TTFT against its prediction goes to
  ``pdproxy_kv_router_ttft_prediction_error``.

A shed plan (``plan.ttft.shed``) is refused by the router before anything is charged (429 with
``Retry-After``). Only sheddable classes are ever shed, so a class that is not (``interactive``)
is never refused to make room for one that is (``batch``): the latter yields instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.residency.types import NodeId
from pdproxy.routing.base import RequestOutcome, RouteRequest
from pdproxy.routing.kv.latency.predict import (
    Prompt,
    Target,
    Way,
    alone_way,
    choose,
    defer,
    keep_prefix,
    pair_way,
    ways,
)
from pdproxy.routing.kv.latency.rates import NodeRate, PoolRates
from pdproxy.routing.kv.plan import NO_MATCH, Plan, held_blocks
from pdproxy.routing.kv.scorers.base import Ask, Costing, Made, Over, Scorer, View, rows
from pdproxy.settings.routing import KvRouterSettings

_ERROR_BUCKETS = (
    -0.9, -0.5, -0.3, -0.2, -0.1, -0.05, 0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
"""Predicted over observed TTFT, minus one: 0 is exact, -0.5 predicted half of what it took."""


@dataclass(frozen=True, slots=True)
class TtftView(View):
    rates: Mapping[str, NodeRate]
    target: Target
    warm: bool
    block_size: int
    consumer_local: bool
    """``pd_cached_tokens: consumer_local``: a PD consumer reports only its own hits."""
    bypass: bool = True
    """False: the plan's kind (pair or alone, the thresholds' choice) is kept."""
    bypass_unlearned: bool = False
    """``bypass: true`` as asked: a way not learned for the request's work (a seed, an
    extrapolation) may change the kind too."""
    error_share: float = 1.0
    """How far off the pool's recent warm predictions were (:func:`keep_prefix`'s band)."""

    def revise(self, plan: Plan, costing: Costing) -> Plan:
        if not self.warm:
            return plan
        shape = costing.prompt
        prompt = Prompt(shape.tokens if shape is not None else 0, self.block_size)
        prods = [(n.name, held_blocks(n.match)) for n in costing.producers]
        cons = [(n.name, held_blocks(n.match)) for n in costing.consumers]
        options = ways(prompt, prods, cons, _with_charged_backlog(self.rates, costing))
        alone = not plan.producers
        if not self.bypass:
            options = [w for w in options if w.alone == alone]
            if not options:  # only self-pairs: the thresholds' plan stands
                return plan
        choice = choose(options, self.target)
        allowed = options
        way = choice.way
        if way is not None and way.alone != alone and not (way.learned or self.bypass_unlearned):
            # A way predicted with a seed or past the work its line was learned on (a consumer
            # that prefilled only short suffixes alone, read for a whole prompt) does not
            # overturn the thresholds' kind: uncertain, the cost rule decides pair or alone and
            # the prediction ranks within.
            kept = [w for w in options if w.alone == alone]
            if kept:
                choice = choose(kept, self.target)
                allowed = kept
        top = (plan.consumers[0], plan.producers[0] if plan.producers else None)
        cost = next((w for w in options if (w.consumer, w.producer) == top), None)
        choice = defer(dataclasses.replace(choice, cost=cost), cost)
        choice = keep_prefix(choice, allowed, self.error_share)
        node_ms: dict[str, float] = {}
        for w in options:
            for name in (w.consumer, w.producer):
                if name is not None and w.ttft_ms < node_ms.get(name, float("inf")):
                    node_ms[name] = w.ttft_ms
        choice = dataclasses.replace(choice, node_ms=node_ms, error_share=self.error_share)
        way = choice.way
        if way is None:
            return dataclasses.replace(plan, reason="ttft-shed", ttft=choice)
        consumers = (way.consumer, *[c for c in plan.consumers if c != way.consumer])
        producers: tuple[str, ...] = ()
        if way.producer is not None:
            rest = sorted(
                (p for p, _ in prods if p != way.producer),
                key=lambda p: (node_ms.get(p, float("inf")), p),
            )
            producers = (way.producer, *rest)
        held = dict(cons).get(way.consumer, 0)
        cached = held if way.alone or self.consumer_local else prompt.blocks
        cacheable = max(prompt.tokens - 1, 0) // self.block_size * self.block_size
        producer_cached = None
        if way.producer is not None:
            p_held = dict(prods).get(way.producer, 0)
            producer_cached = min(p_held * self.block_size, cacheable)
        return dataclasses.replace(
            plan,
            consumers=consumers,
            producers=producers,
            reason="ttft-alone" if way.alone else "ttft",
            predicted_cached_tokens=min(cached * self.block_size, cacheable),
            predicted_producer_cached_tokens=producer_cached,
            ttft=choice,
        )


def _with_charged_backlog(
    rates: Mapping[str, NodeRate], costing: Costing
) -> Mapping[str, NodeRate]:
    """Each candidate's backlog at least the prefill tokens the router charged it and has not
    seen finished (``queued_tokens``: with shared state, every replica's): the learned backlog
    drains at the learned rate, and a burst routed to one node before any of its legs was
    observed would otherwise look drained while it still queues there. Requests that are past
    their prefill and decoding count too until they finish, as in the cost model's load."""
    out: dict[str, NodeRate] | None = None
    for node in (*costing.producers, *costing.consumers):
        rate = rates.get(node.name)
        if rate is not None and node.queued_tokens > rate.backlog_tokens:
            out = dict(rates) if out is None else out
            out[node.name] = dataclasses.replace(rate, backlog_tokens=float(node.queued_tokens))
    return rates if out is None else out


@dataclass(frozen=True, slots=True)
class _Pending:
    """What a decision predicted, kept until its request is over."""

    way: Way
    stream: bool
    warm: bool


class _RatesCollector(Collector):
    def __init__(self, rates: PoolRates, clock: Callable[[], float]) -> None:
        self._rates = rates
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"pdproxy_kv_ttft_{name}", doc, labels=["node"])

        per_token = gauge("prefill_ms_per_token", "A node's learned prefill time per token")
        leg = gauge("leg_ms", "A node's learned fixed time of a prefill leg")
        step = gauge("first_step_ms", "A node's learned time from a PD consumer leg to its "
                     "first token, KV transfer aside")  # fmt: skip
        fetch = gauge("fetch_ms_per_block", "A node's learned time to fetch one block (PD)")
        backlog = gauge("backlog_tokens", "Prefill tokens the router believes queued on a node")
        samples = GaugeMetricFamily(
            "pdproxy_kv_ttft_samples",
            "Observed legs a node's line learned from (line: compute or fetch)",
            labels=["node", "line"],
        )
        for node, rate in self._rates.exported(self._clock()).items():
            per_token.add_metric([node], rate.compute.slope)
            leg.add_metric([node], rate.compute.intercept)
            step.add_metric([node], rate.fetch.intercept)
            fetch.add_metric([node], rate.fetch.slope)
            backlog.add_metric([node], rate.backlog_tokens)
        for node, live in self._rates.items():
            samples.add_metric([node, "compute"], live.compute.line.samples)
            samples.add_metric([node, "fetch"], live.fetch.line.samples)
        yield from (per_token, leg, step, fetch, backlog, samples)


class TtftScorer(Scorer[TtftView]):
    name = "ttft"

    def __init__(
        self,
        settings: KvRouterSettings,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings.ttft
        self._clock = clock
        self.rates = PoolRates(settings.ttft)
        self._block_size = settings.block_size
        self._consumer_local = settings.pd_cached_tokens == "consumer_local"
        bypass = settings.ttft.bypass
        self.bypass = (
            bypass if bypass is not None else not settings.local_prefill.always_disaggregated
        )
        self._targets = {name: self._target(name, None) for name in self.settings.classes}
        self._pending: dict[str, _Pending] = {}
        self.error = Histogram(
            "pdproxy_kv_router_ttft_prediction_error",
            "Predicted over observed TTFT minus one, per streamed request (mode: pd or alone; "
            "warm: whether the pool's rates were learned when it was predicted)",
            ["mode", "warm"],
            buckets=_ERROR_BUCKETS,
            registry=registry,
        )
        self.shed = Counter(
            "pdproxy_kv_router_ttft_shed",
            "Requests refused because no candidate was predicted to meet their target, by class",
            ["ttft_class"],
            registry=registry,
        )

    def _target(self, name: str, target_ms: float | None) -> Target:
        s = self.settings
        klass = s.classes[name]
        protected = s.protected_ms()
        return Target(
            name,
            target_ms if target_ms is not None else klass.target_ms,
            klass.sheddable,
            klass.yields,
            klass.placement,
            protected * s.yield_share if klass.yields and protected is not None else None,
            s.headroom_share,
            s.explore_share,
        )

    def target_of(self, request: RouteRequest) -> Target:
        """The request's class (its key's, else the default) and target (a trusted caller's
        own, else the class's)."""
        name = request.ttft_class
        if name is None or name not in self._targets:
            name = self.settings.default_class
        if request.ttft_target_ms is not None:
            return self._target(name, request.ttft_target_ms)
        return self._targets[name]

    def observe(self, ask: Ask) -> TtftView:
        names = list(dict.fromkeys(b.name for b in ask.candidates))
        enabled = self.settings.enabled
        return TtftView(
            self.rates.snapshot(names, ask.now) if enabled else {},
            self.target_of(ask.request),
            enabled and self.rates.warm,
            self._block_size,
            self._consumer_local,
            self.bypass,
            self.settings.bypass is True,
            self.rates.error_share,
        )

    def record(self, made: Made, view: TtftView) -> None:
        if not self.settings.enabled:
            return
        plan = made.plan
        way = plan.ttft.way if plan.ttft is not None else None
        chosen = (plan.consumers[0], plan.producers[0] if plan.producers else None)
        if way is None or (way.consumer, way.producer) != chosen:  # cold, or a later revise
            way = self._way_of(made, view)
        if way is None:
            return
        self.rates.queue(way.prefill_node, way.prefill_tokens, made.now)
        stream = made.request.body.get("stream") is True
        self._pending[made.request.request_id] = _Pending(way, stream, view.warm)

    def _way_of(self, made: Made, view: TtftView) -> Way | None:
        """The plan's own choice as a way (a cold pool: the cost model chose)."""
        plan = made.plan
        prompt = Prompt(made.prompt.tokens if made.prompt is not None else 0, self._block_size)
        consumer = plan.consumers[0]
        c_rate = view.rates.get(consumer)
        if c_rate is None:
            return None
        c_held = held_blocks(made.matches.get(NodeId(consumer), NO_MATCH))
        if not plan.producers:
            return alone_way(prompt, consumer, c_held, c_rate)
        producer = plan.producers[0]
        p_rate = view.rates.get(producer)
        if p_rate is None:
            return None
        p_held = held_blocks(made.matches.get(NodeId(producer), NO_MATCH))
        return pair_way(prompt, (producer, p_held), p_rate, (consumer, c_held), c_rate)

    def refused(self, target: Target) -> None:
        """The router refused a shed decision's request."""
        self.shed.labels(target.name).inc()

    def finished(self, over: Over, outcome: RequestOutcome) -> None:
        pending = self._pending.pop(over.request_id, None)
        if pending is None or not outcome.ok:
            return
        way = pending.way
        over_now = self._clock()
        first_ms = outcome.consumer_first_byte_s * 1e3
        first = pending.stream and outcome.consumer == way.consumer and first_ms > 0.0
        observed: float | None = None
        if way.producer is not None:
            if outcome.producer != way.producer or outcome.producer_s <= 0.0:
                return  # another producer served it, or none did: not this way's timing
            prefill_ms = outcome.producer_s * 1e3
            self.rates.observe_compute(way.producer, way.prefill_work, prefill_ms, over_now)
            if pending.warm:
                self.rates.observe_error(way.prefill_ms, prefill_ms)
            if first:
                self.rates.observe_fetch(
                    way.consumer, way.fetch_blocks, first_ms - way.consumer_queue_ms
                )
                observed = prefill_ms + first_ms
        elif first and outcome.producer is None:
            self.rates.observe_compute(way.consumer, way.prefill_work, first_ms, over_now)
            observed = first_ms
        if observed is not None and observed > 0.0:
            if pending.warm:
                self.rates.observe_error(way.ttft_ms, observed)
            self.error.labels("alone" if way.alone else "pd", str(pending.warm).lower()).observe(
                way.ttft_ms / observed - 1.0
            )

    def annotate(self, explain: Mapping[str, Any], now: float) -> None:
        """Each row gains its node's learned prefill rate and backlog (its prediction is the
        row's ``ttft_ms``; the lines in full are in the metrics)."""
        if not self.settings.enabled:
            return
        names = [str(row.get("name")) for row in rows(explain)]
        rates = self.rates.snapshot(names, now)
        for row in rows(explain):
            rate = rates[str(row.get("name"))]
            # Compact: the header shows every row; the full lines are in the metrics.
            row["ms_per_token"] = round(rate.compute.slope, 3)
            if rate.backlog_tokens >= 1.0:
                row["backlog"] = round(rate.backlog_tokens)


def build(
    settings: KvRouterSettings,
    registry: CollectorRegistry,
    clock: Callable[[], float] = time.monotonic,
) -> TtftScorer:
    scorer = TtftScorer(settings, registry, clock)
    registry.register(_RatesCollector(scorer.rates, clock))
    return scorer
