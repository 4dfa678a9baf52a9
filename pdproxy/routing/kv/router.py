"""The KV-aware router: one decision over one :class:`~pdproxy.routing.kv.state.RouterState`.

One decision, step by step (:meth:`KvRouter.route`):

1. filter: the request path's chain (:mod:`pdproxy.routing.candidates`) gave this router only
   candidates the request can use (model, role, routable, dialect); none left is a 503.
2. observe (:meth:`KvRouter._observe`, the only I/O): the prompt → block hashes of its routed
   prefix (:mod:`~pdproxy.routing.kv.prompt_hash`; a request that cannot be hashed goes on with
   no prompt: load alone); ``state.observe``: matches and the nodes' load (one round trip for
   both with Redis; with the shared store down, this replica's own load and no matches); each
   scorer's view of the decision (:mod:`~pdproxy.routing.kv.scorers`).
3. score and pick (:func:`~pdproxy.routing.kv.decide.decide`): pure over what was observed.
   A plan the TTFT scorer shed (no candidate predicted within a sheddable request's target)
   is refused here, 429 with ``Retry-After``, before anything is charged.
4. record (:meth:`KvRouter._record`): the scorers' bookkeeping; ``state.record`` charges the
   chosen nodes and writes speculative residency for the prompt's blocks
   (:func:`~pdproxy.routing.kv.state.charges`); the decision, its explanation and metrics.
   ``finished`` releases exactly that charge.

The router never asks whether its state is local or shared, and its decision never names a
signal: the scorers are the registry's (:data:`~pdproxy.routing.kv.scorers.SCORERS`). Only its
construction does, to wire the I/O that feeds two of them (KV events, engine scrapes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from kvtier.keys import BlockHasher
from pdproxy.errors import NoBackendAvailable, Overloaded
from pdproxy.fleet.backends import BreakerState
from pdproxy.routing.base import B, RequestOutcome, RouteDecision, RouteRequest
from pdproxy.routing.kv.decide import Scoring, decide, scoring_of
from pdproxy.routing.kv.event_feeds import EventFeeds
from pdproxy.routing.kv.explain import decision_of
from pdproxy.routing.kv.latency.predict import Choice
from pdproxy.routing.kv.plan import Plan, PromptShape
from pdproxy.routing.kv.prompt_hash import HashedPrompt, PromptHasher
from pdproxy.routing.kv.scorers import build_scorers
from pdproxy.routing.kv.scorers.base import Ask, Made, Over, Scorer, View, overriding
from pdproxy.routing.kv.scorers.engine_load import EngineLoadScorer
from pdproxy.routing.kv.scorers.index_exactness import IndexExactnessScorer
from pdproxy.routing.kv.scorers.pull import PullScorer
from pdproxy.routing.kv.scorers.ttft import TtftScorer
from pdproxy.routing.kv.state import (
    LoadDelta,
    Observation,
    Prediction,
    RouterState,
    charges,
    predictions,
)
from pdproxy.routing.kv.telemetry import KvRouterMetrics, observe_drift
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.tokenize.base import Tokenizer

logger = logging.getLogger(__name__)

S = TypeVar("S", bound=Scorer[Any])


@dataclass(frozen=True, slots=True)
class _Seen:
    """What one decision observed."""

    hashed: HashedPrompt | str
    """The prompt's hashes, or why it could not be hashed."""
    observation: Observation
    prompt: PromptShape | None
    """None: route by load alone (unhashable, or the index did not answer)."""
    views: tuple[View, ...]
    """Each scorer's view, in the registry's order."""
    now: float


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
        self.scorers = build_scorers(settings, metrics.registry)
        recording = overriding(self.scorers, "record")
        self._recording = [i for i, s in enumerate(self.scorers) if s in recording]
        """Indexes of the scorers (and of their views) whose ``record`` is not the default."""
        self._annotating = overriding(self.scorers, "annotate")
        self._finishing = overriding(self.scorers, "finished")
        # The I/O that feeds signals: the KV event feeds follow each stream's exactness, and
        # the workers' pull counters (scraped with engine load) teach pull its link speed.
        exactness = self.find(IndexExactnessScorer)
        self.feeds = EventFeeds(
            state.index,
            metrics.event_apply_errors.inc,
            shared=state.shared,
            curve=settings.events_curve,
            leases=state.leases,
            on_rank_refused=lambda node: metrics.events_rank_refused.labels(node).inc(),
            exactness=exactness.exactness if exactness is not None else None,
            max_message_bytes=settings.event_max_message_bytes,
            apply_blocks=settings.event_apply_blocks,
        )
        metrics.follow_feeds(self.feeds, state.index)
        self._ttft = self.find(TtftScorer)
        engine, pull = self.find(EngineLoadScorer), self.find(PullScorer)
        if engine is not None and pull is not None:
            engine.readings.on_pull = lambda node, m: pull.measured(m.nbytes, m.seconds)
        ttft = self._ttft
        if engine is not None and ttft is not None:  # the engines' queues floor the backlog
            engine.readings.on_reading = lambda node, r: ttft.rates.engine_waiting(
                node, r.sample.waiting, r.at
            )
        self._background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.closed = False
        """True once :meth:`close` has run (its feeds, tasks and state let go)."""

    def find(self, kind: type[S]) -> S | None:
        """This router's scorer of type ``kind``, if the registry has one."""
        return next((s for s in self.scorers if isinstance(s, kind)), None)

    def scorer(self, kind: type[S]) -> S:
        found = self.find(kind)
        if found is None:
            raise LookupError(f"no {kind.__name__} in the scorer registry")
        return found

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
        self.closed = True

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
        if not consumers:  # filter: routing/candidates.py left no consumer
            raise NoBackendAvailable("no routable consumer")
        seen = await self._observe(request, producers, consumers)
        scoring = scoring_of(
            seen.prompt, seen.observation, [b.name for b in producers],
            [b.name for b in consumers], views=seen.views, block_size=self.settings.block_size,
        )  # fmt: skip
        plan = decide(scoring, self.settings)
        if plan.ttft is not None and plan.ttft.shed:
            self._shed(request, plan.ttft)
        decided_s = time.perf_counter() - t0
        return await self._record(
            request, producers, consumers, seen=seen, scoring=scoring, plan=plan, t0=t0,
            decided_s=decided_s,
        )  # fmt: skip

    def _shed(self, request: RouteRequest, choice: Choice) -> NoReturn:
        """Refuse a request no candidate is predicted to serve within its target (nothing
        was charged yet)."""
        self.metrics.decisions.labels("ttft-shed").inc()
        if self._ttft is not None:
            self._ttft.refused(choice.target)
        logger.info(
            "route %s: shed (%s: best %.0f ms, target %s ms)", request.request_id,
            choice.target.name, choice.best.ttft_ms, choice.target.target_ms,
        )  # fmt: skip
        raise Overloaded(
            "no backend is predicted to serve this request within its latency target",
            choice.retry_after_s,
        )

    async def _observe(
        self, request: RouteRequest, producers: Sequence[B], consumers: Sequence[B]
    ) -> _Seen:
        names = sorted({b.name for b in producers} | {b.name for b in consumers})
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
        now = time.monotonic()
        ask = Ask(request, [*producers, *consumers], now)
        return _Seen(hashed, seen, prompt, tuple([s.observe(ask) for s in self.scorers]), now)

    async def _record(
        self,
        request: RouteRequest,
        producers: Sequence[B],
        consumers: Sequence[B],
        *,
        seen: _Seen,
        scoring: Scoring,
        plan: Plan,
        t0: float,
        decided_s: float,
    ) -> RouteDecision[B]:
        matches = scoring.matches
        made = Made(request, plan, seen.prompt, matches, seen.now)
        for i in self._recording:
            self.scorers[i].record(made, seen.views[i])
        hashed, observed = seen.hashed, seen.observation.matches
        tokens = hashed.tokens if isinstance(hashed, HashedPrompt) else 0
        deltas = charges(plan, tokens, matches, self.settings.block_size)
        predicted: list[Prediction] = []
        if isinstance(hashed, HashedPrompt) and observed is not None:
            predicted = predictions(plan, hashed.hashes, observed)
        try:
            recorded = await self.state.record(deltas, predicted, self.settings.prediction_ttl_s)
        except Exception:
            logger.exception("route %s: recording the decision failed", request.request_id)
            recorded = False
        route_s = time.perf_counter() - t0
        decision = decision_of(
            plan,
            request_id=request.request_id,
            prods=producers,
            cons=consumers,
            hashed=hashed,
            matches=matches,
            source=seen.observation.source,
            decided_s=decided_s,
            route_s=route_s,
        )
        for scorer in self._annotating:
            scorer.annotate(decision.explain, seen.now)
        stale = self._tickets.pop(request.request_id, None)
        if stale is not None:  # a caller reusing an id in flight: release what it charged
            logger.warning("route %s: request id already in flight", request.request_id)
            self.state.local.apply(tuple(d.negated() for d in stale.deltas))
        blocks = seen.prompt.blocks if seen.prompt is not None else 0
        mode = "pd" if plan.producers else "alone"
        self._tickets[request.request_id] = _Ticket(
            decision, deltas, recorded, mode, request.session, blocks
        )
        self.metrics.decisions.labels(plan.reason).inc()
        self.metrics.route_seconds.observe(route_s)
        if seen.prompt is not None:
            self.metrics.prompt_tokens.inc(seen.prompt.tokens)
            self.metrics.predicted_hit_tokens.inc(plan.predicted_cached_tokens)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s: %s consumer=%s producer=%s index=%s decide=%.3fms scores=%s",
                request.request_id, plan.reason, plan.consumers[0],
                plan.producers[0] if plan.producers else "-", seen.observation.source,
                decided_s * 1e3, decision.explain.get("consumers"),
            )  # fmt: skip
        return decision

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        try:
            ticket = self._tickets.get(decision.request_id)
            if ticket is None or ticket.decision is not decision:
                return
            del self._tickets[decision.request_id]
            over = Over(decision.request_id, ticket.session, ticket.blocks)
            for scorer in self._finishing:
                try:
                    scorer.finished(over, outcome)
                except Exception:  # one scorer's bug must not keep the charge
                    logger.exception("kv router: scorer %s failed in finished()", scorer.name)
            release = tuple(d.negated() for d in ticket.deltas)
            await self.state.release(release, ticket.recorded)
            block_size = self.settings.block_size
            checks = observe_drift(self.metrics, decision, outcome, ticket.mode, block_size)
            for check in checks:
                if check.result(block_size) == "off":
                    # A persistent miss means the router's view of that engine is wrong
                    # (hashing, tokenizer, or events it never got): worth a line per request.
                    logger.info(
                        "route %s: %s %s predicted %d cached tokens, engine reported %d",
                        decision.request_id, check.leg, check.node, check.predicted,
                        check.reported,
                    )  # fmt: skip
        except Exception:  # finished must never raise into the request path
            logger.exception("kv router: finished() failed for a decision")
