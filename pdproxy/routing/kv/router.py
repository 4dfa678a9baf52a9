"""The KV-aware router: one decision over one :class:`~pdproxy.routing.kv.state.RouterState`.

One decision, step by step:

1. The prompt → block hashes of its routed prefix (:mod:`pdproxy.routing.kv.prompt_hash`);
   requests that cannot be hashed go on with no prompt: load alone.
2. ``state.observe``: matches and the nodes' load (one round trip for both with Redis; with the
   shared store down, this replica's own load and no matches).
3. :func:`~pdproxy.routing.kv.cost.plan_route` ranks consumers and producers.
4. ``state.record``: the chosen nodes are charged and get speculative residency for the prompt's
   blocks (:mod:`pdproxy.routing.kv.charges`); ``finished`` releases exactly that charge.

The router never asks whether its state is local or shared.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import BlockHasher
from kvtier.residency.types import NodeId
from pdproxy.errors import NoBackendAvailable
from pdproxy.fleet.backends import BreakerState
from pdproxy.routing.base import B, RequestOutcome, RouteDecision, RouteRequest
from pdproxy.routing.kv.affinity import SessionAffinity
from pdproxy.routing.kv.charges import load_deltas, predictions
from pdproxy.routing.kv.cost import NO_MATCH, NodeState, PromptShape, plan_route
from pdproxy.routing.kv.event_feeds import EventFeeds
from pdproxy.routing.kv.explain import HashedPrompt, decision_of
from pdproxy.routing.kv.load import LoadDelta, NodeLoad
from pdproxy.routing.kv.node_signals import NodeSignals
from pdproxy.routing.kv.prompt_hash import PromptHasher
from pdproxy.routing.kv.pull import pull_deltas
from pdproxy.routing.kv.pull_planner import PullPlanner, with_pull
from pdproxy.routing.kv.settings import KvRouterSettings
from pdproxy.routing.kv.signals_metrics import SignalMetrics
from pdproxy.routing.kv.state import Observation, RouterState
from pdproxy.routing.kv.telemetry import KvRouterMetrics, observe_drift
from pdproxy.tokenize.base import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Ticket:
    """What a decision charged, so ``finished`` releases exactly that."""

    decision: RouteDecision[Any]
    deltas: tuple[LoadDelta, ...]
    recorded: bool
    mode: str
    session: str | None = None
    blocks: int = 0


class KvRouter:
    """Implements :class:`pdproxy.routing.base.Router` over ``state``."""

    def __init__(
        self,
        settings: KvRouterSettings,
        *,
        state: RouterState,
        tokenizer: Tokenizer,
        metrics: KvRouterMetrics,
        on_close: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.state = state
        self._prompts = PromptHasher(settings, tokenizer, metrics)
        self._on_close = tuple(on_close)
        self._tickets: dict[str, _Ticket] = {}
        """What each decision in flight charged, by request id."""
        self.affinity = SessionAffinity(settings.affinity, metrics.registry)
        self.signals = NodeSignals(settings)
        """Engine-reported load and index exactness per node."""
        self.signal_metrics = SignalMetrics(self.signals, metrics.registry)
        self.feeds = EventFeeds(
            state.index,
            metrics.event_apply_errors.inc,
            shared=state.shared,
            curve=settings.events_curve,
            leases=state.leases,
            on_rank_refused=lambda node: metrics.events_rank_refused.labels(node).inc(),
            exactness=self.signals.exactness,
        )
        self._background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.pulls = PullPlanner(settings.pull, settings.weights, metrics.registry)
        # The workers' pull counters, scraped with engine load, teach the planner the link speed.
        self.signals.readings.on_pull = lambda node, m: self.pulls.observe(m.nbytes, m.seconds)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.feeds.start()
        for node, endpoint in sorted(self.settings.events.items()):
            await self.feeds.subscribe(node, endpoint, self.settings.replay.get(node))
        await self.state.start()
        self._tasks = [
            asyncio.create_task(job(), name=f"kv-router {job.__name__}") for job in self._background
        ]

    def add_background(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A coroutine to run from :meth:`start` until :meth:`close`."""
        self._background.append(job)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.feeds.close()
        await self._prompts.tokenizer.close()
        await self.state.close()
        for close in self._on_close:
            await close()

    @property
    def hasher(self) -> BlockHasher:
        """The block hasher of this router's model (the index is keyed by its hashes)."""
        return self._prompts.hasher

    @property
    def breaker_state(self) -> BreakerState:
        return self.state.breaker_state

    # -- the decision ----------------------------------------------------------------------

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[B],
        consumers: Sequence[B],
    ) -> RouteDecision[B]:
        t0 = time.perf_counter()
        cons = [b for b in consumers if b.routable]
        if not cons:
            raise NoBackendAvailable("no routable consumer")
        prods = [b for b in producers if b.routable]
        names = sorted({b.name for b in prods} | {b.name for b in cons})
        hashed: HashedPrompt | str
        try:
            hashed = await self._prompts.hash(request)
            hashes = hashed.hashes if isinstance(hashed, HashedPrompt) else None
            seen = await self.state.observe(hashes, names)
        except Exception:  # a bug or a foreign failure must not fail the request: load only
            logger.exception("route %s: KV path failed; routing by load", request.request_id)
            hashed = "router-error"
            local = self.state.local
            seen = Observation(None, {n: local.get(n) for n in names}, "fallback")
        if seen.source == "fallback":
            self.metrics.fallbacks.inc()
        prompt = None
        if isinstance(hashed, HashedPrompt) and seen.matches is not None:
            prompt = PromptShape(hashed.tokens, self.settings.block_size)
        m = seen.matches or {}
        sticky = self.affinity.sticky_node(request.session)
        if sticky is not None and prompt is not None:  # routing/kv/affinity.py
            m = self.affinity.boost(sticky, m, prompt.blocks)
        loads = seen.loads
        now = time.monotonic()

        def node_state(b: B) -> NodeState:
            load = loads.get(b.name, NodeLoad())
            match, engine = self.signals.adjust(b.name, m.get(NodeId(b.name), NO_MATCH), now)
            return NodeState(b.name, match, load.in_flight, load.queued_tokens, engine)

        p_states, c_states = [node_state(b) for b in prods], [node_state(b) for b in cons]
        plan = plan_route(prompt, p_states, c_states, self.settings)
        pulled = self.pulls.consider(
            request.request_id, plan, prompt, p_states, c_states, backends=[*prods, *cons]
        )
        if pulled is not None:
            plan = pulled.plan
        decided_s = time.perf_counter() - t0
        self.signals.after_plan(plan, prompt, m, now)
        deltas = load_deltas(plan, hashed, m, self.settings.block_size)
        if pulled is not None and prompt is not None:
            deltas = pull_deltas(deltas, pulled, prompt.tokens, self.settings.block_size)
        try:
            recorded = await self.state.record(
                deltas, predictions(plan, hashed, seen.matches), self.settings.prediction_ttl_s
            )
        except Exception:
            logger.exception("route %s: recording the decision failed", request.request_id)
            recorded = False
        route_s = time.perf_counter() - t0
        decision = decision_of(
            plan,
            request_id=request.request_id,
            prods=prods,
            cons=cons,
            hashed=hashed,
            matches=m,
            source=seen.source,
            decided_s=decided_s,
            route_s=route_s,
        )
        self.signals.annotate(decision.explain, now)
        decision = with_pull(decision, pulled)
        mode = "pd" if plan.producers else "alone"
        stale = self._tickets.pop(request.request_id, None)
        if stale is not None:  # a caller reusing an id in flight: release what it charged
            logger.warning("route %s: request id already in flight", request.request_id)
            self.state.local.apply(tuple(d.negated() for d in stale.deltas))
        blocks = prompt.blocks if prompt is not None else 0
        self._tickets[request.request_id] = _Ticket(
            decision, deltas, recorded, mode, request.session, blocks
        )
        if request.session is not None:
            self.affinity.chosen(sticky, plan.consumers[0])
        self.metrics.decisions.labels(plan.reason).inc()
        self.metrics.route_seconds.observe(route_s)
        if prompt is not None:
            self.metrics.prompt_tokens.inc(prompt.tokens)
            self.metrics.predicted_hit_tokens.inc(plan.predicted_cached_tokens)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s: %s consumer=%s producer=%s index=%s decide=%.3fms scores=%s",
                request.request_id, plan.reason, plan.consumers[0],
                plan.producers[0] if plan.producers else "-", seen.source, decided_s * 1e3,
                decision.explain.get("consumers"),
            )  # fmt: skip
        return decision

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        try:
            ticket = self._tickets.get(decision.request_id)
            if ticket is None or ticket.decision is not decision:
                return
            del self._tickets[decision.request_id]
            self.pulls.finished(decision.request_id)
            release = tuple(d.negated() for d in ticket.deltas)
            await self.state.release(release, ticket.recorded)
            if outcome.ok and outcome.consumer is not None:
                self.affinity.remember(ticket.session, outcome.consumer, ticket.blocks)
            observe_drift(self.metrics, decision, outcome, ticket.mode)
        except Exception:  # finished must never raise into the request path
            logger.exception("kv router: finished() failed for a decision")
