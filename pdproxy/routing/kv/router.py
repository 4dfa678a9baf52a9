"""The KV-aware router: tokenize, hash, match against the residency index, score, record.

One decision, step by step:

1. The prompt → token ids (by the pool's tokenizer) → chained block hashes of at most
   ``max_route_blocks`` leading blocks (the decision routes on that prefix, so one huge prompt
   costs the event loop a bounded amount of hashing, matching and prediction; hashing runs in a
   thread above ``inline_hash_blocks``). Requests that cannot be hashed faithfully (images,
   embeddings, tokenizer failure) go on with no prompt: load alone.
2. ``index.match(hashes)`` and the nodes' load, together (one round trip each with Redis).
3. :func:`~pdproxy.routing.kv.cost.plan_route` ranks consumers and producers.
4. The chosen nodes are charged (in flight +1, their uncached prefill tokens queued) and get
   speculative residency for the prompt's blocks, so siblings arriving before the KV events
   follow the first request.

With a shared store every call to it runs under :class:`StoreGuard`; when the store fails the
decision falls back to load alone (this replica's own load) and ``route`` still answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvtier.errors import InvalidTokensError, ResidencyError
from kvtier.keys import BlockHash, BlockHasher
from kvtier.residency.types import Match, NodeId, ResidencyIndex
from pdproxy.errors import NoBackendAvailable
from pdproxy.routing.base import B, RequestOutcome, RouteDecision, RouteRequest
from pdproxy.routing.kv.cost import NO_MATCH, NodeState, Plan, PromptShape, held_blocks, plan_route
from pdproxy.routing.kv.event_feeds import EventFeeds
from pdproxy.routing.kv.explain import HashedPrompt, decision_of
from pdproxy.routing.kv.load import LoadDelta, MemoryLoad, NodeLoad
from pdproxy.routing.kv.settings import KvRouterSettings
from pdproxy.routing.kv.shared_load import RedisLoad
from pdproxy.routing.kv.store_guard import BreakerState, StoreGuard
from pdproxy.routing.kv.telemetry import KvRouterMetrics
from pdproxy.tokenize.base import Tokenizer, token_ids
from pdproxy.tokenize.errors import TokenizationError
from pdproxy.tokenize.prompt import Unhashable, cache_salt_of, prompt_of

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Ticket:
    """What a decision charged, so ``finished`` releases exactly that."""

    decision: RouteDecision[Any]
    deltas: tuple[LoadDelta, ...]
    shared: bool
    mode: str


class KvRouter:
    """Implements :class:`pdproxy.routing.base.Router`.

    ``shared_load`` is given when the index is shared (Redis): load then lives there too, and
    every call to the index or the load counters runs under the store guard.
    """

    def __init__(
        self,
        settings: KvRouterSettings,
        *,
        index: ResidencyIndex,
        tokenizer: Tokenizer,
        metrics: KvRouterMetrics,
        shared_load: RedisLoad | None = None,
        on_close: Sequence[Callable[[], Awaitable[None]]] = (),
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._index = index
        self._tokenizer = tokenizer
        self._hasher = BlockHasher(settings.model_seed, settings.block_size)
        self._local = MemoryLoad()
        self._shared = shared_load
        self._on_close = tuple(on_close)
        self._tickets: dict[str, _Ticket] = {}
        """What each decision in flight charged, by request id."""
        self._guard: StoreGuard | None = None
        if shared_load is not None:
            self._guard = StoreGuard(
                deadline_s=settings.redis_deadline_s,
                failures=settings.breaker_failures,
                cooldown_s=settings.breaker_cooldown_s,
                on_state=self._on_breaker_state,
            )
            self._guard.on_recovered = self._on_recovered
        self.feeds = EventFeeds(
            index,
            metrics.event_apply_errors.inc,
            shared=shared_load is not None,
            curve=settings.events_curve,
        )
        self._background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._resync = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        for node, endpoint in sorted(self.settings.events.items()):
            await self.feeds.subscribe(node, endpoint, self.settings.replay.get(node))
        jobs = list(self._background)
        if self._shared is not None:
            await self._heartbeat_once()
            jobs.append(self._heartbeat_loop)
        self._tasks = [asyncio.create_task(job(), name=f"kv-router {job.__name__}") for job in jobs]

    def add_background(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A coroutine to run from :meth:`start` until :meth:`close`."""
        self._background.append(job)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.feeds.close()
        shared = self._shared
        if shared is not None:
            with contextlib.suppress(ResidencyError):
                await self._store(shared.leave, "leave")
        await self._tokenizer.close()
        await self._index.close()
        for close in self._on_close:
            await close()

    @property
    def breaker_state(self) -> BreakerState:
        return self._guard.state if self._guard is not None else BreakerState.CLOSED

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
            hashed = await self._hash(request)
            matches, loads, source = await self._observe(hashed, names)
        except Exception:  # a bug or a foreign failure must not fail the request: load only
            logger.exception("route %s: KV path failed; routing by load", request.request_id)
            hashed, matches, source = "router-error", None, "fallback"
            loads = {n: self._local.get(n) for n in names}
        prompt = None
        if isinstance(hashed, HashedPrompt) and matches is not None:
            prompt = PromptShape(hashed.tokens, self.settings.block_size)
        m = matches or {}

        def state(b: B) -> NodeState:
            load = loads.get(b.name, NodeLoad())
            return NodeState(b.name, m.get(NodeId(b.name), NO_MATCH), load.in_flight,
                             load.queued_tokens)  # fmt: skip

        plan = plan_route(
            prompt, [state(b) for b in prods], [state(b) for b in cons], self.settings
        )
        decided_s = time.perf_counter() - t0
        deltas = self._deltas(plan, hashed, m)
        try:
            shared_ok = await self._record(plan, hashed, deltas, matches)
        except Exception:
            logger.exception("route %s: recording the decision failed", request.request_id)
            shared_ok = False
        route_s = time.perf_counter() - t0
        decision = decision_of(
            plan,
            request_id=request.request_id,
            prods=prods,
            cons=cons,
            hashed=hashed,
            matches=m,
            source=source,
            decided_s=decided_s,
            route_s=route_s,
        )
        mode = "pd" if plan.producers else "alone"
        stale = self._tickets.pop(request.request_id, None)
        if stale is not None:  # a caller reusing an id in flight: release what it charged
            logger.warning("route %s: request id already in flight", request.request_id)
            self._local.apply(tuple(d.negated() for d in stale.deltas))
        self._tickets[request.request_id] = _Ticket(decision, deltas, shared_ok, mode)
        self.metrics.decisions.labels(plan.reason).inc()
        self.metrics.route_seconds.observe(route_s)
        if prompt is not None:
            self.metrics.prompt_tokens.inc(prompt.tokens)
            self.metrics.predicted_hit_tokens.inc(plan.predicted_cached_tokens)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route %s: %s consumer=%s producer=%s index=%s decide=%.3fms scores=%s",
                request.request_id, plan.reason, plan.consumers[0],
                plan.producers[0] if plan.producers else "-", source, decided_s * 1e3,
                decision.explain.get("consumers"),
            )  # fmt: skip
        return decision

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        try:
            ticket = self._tickets.get(decision.request_id)
            if ticket is None or ticket.decision is not decision:
                return
            del self._tickets[decision.request_id]
            release = tuple(d.negated() for d in ticket.deltas)
            self._local.apply(release)
            shared = self._shared
            if ticket.shared and shared is not None:
                with contextlib.suppress(ResidencyError):
                    await self._store(lambda: shared.add(release), "release load")
            self._observe_drift(decision, outcome, ticket.mode)
        except Exception:  # finished must never raise into the request path
            logger.exception("kv router: finished() failed for a decision")

    # -- steps -----------------------------------------------------------------------------

    async def _hash(self, request: RouteRequest) -> HashedPrompt | str:
        prompt = prompt_of(request.endpoint, request.body)
        reason: str
        if isinstance(prompt, Unhashable):
            reason = prompt.reason
        else:
            try:
                ids = await token_ids(self._tokenizer, prompt)
                hashes = await self._hash_prefix(ids, cache_salt_of(request.body))
                return HashedPrompt(len(ids), hashes)
            except TokenizationError as exc:
                logger.info("route %s: tokenizer failed (%s); load only", request.request_id, exc)
                reason = "tokenizer-error"
            except InvalidTokensError:
                reason = "invalid-tokens"
        self.metrics.unhashable.labels(reason).inc()
        return reason

    async def _hash_prefix(self, ids: Sequence[int], salt: str | None) -> list[BlockHash]:
        """Hashes of the first ``max_route_blocks`` blocks, in a thread when there are many."""
        bs = self.settings.block_size
        prefix = ids[: self.settings.max_route_blocks * bs]
        if len(prefix) // bs > self.settings.inline_hash_blocks:
            self.metrics.offloaded_hashes.inc()
            return await asyncio.to_thread(self._hasher.hash_tokens, prefix, cache_salt=salt)
        return self._hasher.hash_tokens(prefix, cache_salt=salt)

    async def _observe(
        self, hashed: HashedPrompt | str, names: list[str]
    ) -> tuple[dict[NodeId, Match] | None, dict[str, NodeLoad], str]:
        """Matches (None when the index could not be asked) and loads, plus where they came
        from: ``memory``, ``redis`` or ``fallback``."""
        hashes = hashed.hashes if isinstance(hashed, HashedPrompt) else None
        shared = self._shared
        if shared is None:
            local = {n: self._local.get(n) for n in names}
            if hashes is None:
                return None, local, "memory"
            return await self._index.match(hashes), local, "memory"
        # The load read runs as a task while the match runs inline: two round trips in flight,
        # one task created.
        load_task = asyncio.ensure_future(self._store(lambda: shared.read(names), "load"))
        failed = False
        matches: dict[NodeId, Match] | None = None
        try:
            if hashes is not None:
                matches = await self._store(lambda: self._index.match(hashes), "match")
        except ResidencyError:
            failed = True
        except BaseException:
            load_task.cancel()
            await asyncio.gather(load_task, return_exceptions=True)
            raise
        try:
            loads = await load_task
        except ResidencyError:
            failed = True
            loads = {n: self._local.get(n) for n in names}
        if failed:
            self.metrics.fallbacks.inc()
        return matches, loads, "fallback" if failed else "redis"

    async def _record(
        self,
        plan: Plan,
        hashed: HashedPrompt | str,
        deltas: tuple[LoadDelta, ...],
        matches: dict[NodeId, Match] | None,
    ) -> bool:
        """Charge the chosen nodes and write predictions; True when the shared store took the
        load charge. A node is predicted to hold the blocks past those it is known to hold (by
        events, or by a live prediction: siblings of a burst do not rewrite the same entries)."""
        self._local.apply(deltas)
        ttl = self.settings.prediction_ttl_s
        predictions: list[tuple[NodeId, list[BlockHash]]] = []
        if isinstance(hashed, HashedPrompt) and matches is not None:
            for name in (plan.consumers[0], *plan.producers[:1]):
                node = NodeId(name)
                known = held_blocks(matches.get(node, NO_MATCH))
                if known < len(hashed.hashes):
                    predictions.append((node, hashed.hashes[known:]))
        shared = self._shared
        if shared is None:
            for node, hashes in predictions:
                await self._index.predict(node, hashes, ttl)
            return False
        calls: list[Awaitable[None]] = [self._store(lambda: shared.add(deltas), "charge load")]
        for node, hashes in predictions:
            calls.append(self._store(self._predictor(node, hashes, ttl), "predict"))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ResidencyError):
                raise r
        return not isinstance(results[0], BaseException)

    def _predictor(
        self, node: NodeId, hashes: list[BlockHash], ttl: float
    ) -> Callable[[], Awaitable[None]]:
        return lambda: self._index.predict(node, hashes, ttl)

    def _deltas(
        self, plan: Plan, hashed: HashedPrompt | str, matches: dict[NodeId, Match]
    ) -> tuple[LoadDelta, ...]:
        tokens = hashed.tokens if isinstance(hashed, HashedPrompt) else 0
        bs = self.settings.block_size

        def uncached(node: str) -> int:
            held = held_blocks(matches.get(NodeId(node), NO_MATCH))
            return max(tokens - held * bs, 0)

        consumer = plan.consumers[0]
        if not plan.producers:
            return (LoadDelta(consumer, 1, uncached(consumer)),)
        producer = plan.producers[0]
        return (LoadDelta(consumer, 1, 0), LoadDelta(producer, 1, uncached(producer)))

    def _observe_drift(
        self, decision: RouteDecision[Any], outcome: RequestOutcome, mode: str
    ) -> None:
        predicted = decision.predicted_cached_tokens
        if outcome.cached_tokens is None or predicted is None or not outcome.ok:
            return
        if not decision.consumers or outcome.consumer != decision.consumers[0].name:
            return  # a failover target: the prediction was about another node
        self.metrics.cached_tokens_drift.labels(mode).observe(outcome.cached_tokens - predicted)

    # -- the shared store ------------------------------------------------------------------

    async def _store(self, fn: Callable[[], Awaitable[T]], what: str) -> T:
        guard = self._guard
        if guard is None:
            return await fn()
        return await guard.call(fn, what)

    def _on_breaker_state(self, state: BreakerState) -> None:
        self.metrics.shared_state_up.set(1 if state is BreakerState.CLOSED else 0)

    def _on_recovered(self) -> None:
        self._resync.set()

    async def _heartbeat_once(self) -> None:
        shared = self._shared
        if shared is None:
            return
        try:
            await self._store(lambda: shared.heartbeat(self._local.snapshot()), "heartbeat")
        except ResidencyError:
            return

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.replica_ttl_s / 5
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._resync.wait(), interval)
            self._resync.clear()
            await self._heartbeat_once()
