"""The tiering manager: the primary host page pool composed with secondary tiers.

Guarantees (DESIGN §4):

- **I1 supply ⊇ demand**: for a tier that declared ``REQUEST_LEVEL`` for a request, every key the
  request offers to ``prepare_store`` (its ``keys`` and its ``cascade_only`` keys) reaches the
  tier exactly once, as ``submit_store`` or as ``on_store_failed`` with a reason:

  ============================  ===============================================================
  primary state of the key      what the request-level tier receives
  ============================  ===============================================================
  READABLE (``HIT``)            ``submit_store`` at once — no GPU copy
  write in flight (HIT_PENDING) ``on_store_pending`` now; ``submit_store`` when the write
                                completes (whoever's write it is, vLLM #53062), or
                                ``on_store_failed(WRITE_FAILED)`` when it fails
  absent (``MISS``), copyable   a page is allocated (``keys_to_store``); as for in-flight
  absent, pool exhausted        ``on_store_failed(POOL_EXHAUSTED)`` (refusal counted)
  absent, ``cascade_only``      ``on_store_failed(reason given by the engine)``
  ============================  ===============================================================

- **I2 no waste**: keys already present are never copied again; a BLOCK_LEVEL request cascades
  nothing; block-level tiers receive only keys a request newly wrote (write-through, after
  the write succeeded, if ``accepts_store``).
- ``on_request_finished`` reaches the tiers only after every write the request waits on (its own
  and the ones its keys are parked on) has completed or failed.

Completion is driven by the pool's write listener, so a write finished by anyone (the engine's
``complete_store``, a P2P fetch's ``complete_write``) un-parks its waiters. Deliveries are
batched per (tier, request) and flushed when the outermost call returns; each delivered key is
held by a reference during ``submit_store`` so it stays READABLE for the call.

The manager knows nothing about what its secondary tiers are.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.errors import OffloadError, UnknownKey
from kvtier.keys import OffloadKey
from kvtier.offload.delivery import Outbox
from kvtier.offload.manager import OffloadingManager
from kvtier.offload.pool import HostPagePool, PageRef
from kvtier.offload.tier import SecondaryTier
from kvtier.offload.types import (
    LookupResult,
    OffloadEvent,
    OffloadPolicy,
    PageSpec,
    PrepareStoreOutput,
    ReqContext,
    RequestId,
    StoreFailure,
    TieringStats,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _RequestState:
    ctx: ReqContext
    offered: set[OffloadKey] = field(default_factory=set)
    own_writes: set[OffloadKey] = field(default_factory=set)
    waiting: set[OffloadKey] = field(default_factory=set)
    load_refs: dict[OffloadKey, list[PageRef]] = field(default_factory=dict)
    finished: bool = False


class TieringManager(OffloadingManager):
    """Primary :class:`HostPagePool` plus secondary tiers, in order of preference for loads."""

    def __init__(self, pool: HostPagePool, tiers: Sequence[SecondaryTier] = ()) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"secondary tier names must be unique, got {names}")
        self._pool = pool
        self._tiers = tuple(tiers)
        self._lock = threading.RLock()
        self._depth = 0
        self._outbox = Outbox()
        self._requests: dict[RequestId, _RequestState] = {}
        self._parked: dict[OffloadKey, list[RequestId]] = {}
        self._write_owner: dict[OffloadKey, RequestId] = {}
        self._cascaded = 0
        self._unparked = 0
        self._write_through = 0
        self._failed = 0
        self._refused = 0
        pool.add_write_listener(self._on_write_done)

    @property
    def pool(self) -> HostPagePool:
        return self._pool

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        return self._tiers

    def close(self) -> None:
        """Detach from the pool (the manager is unusable afterwards)."""
        self._pool.remove_write_listener(self._on_write_done)

    def stats(self) -> TieringStats:
        with self._lock:
            return TieringStats(
                cascaded=self._cascaded,
                unparked=self._unparked,
                write_through=self._write_through,
                failed=self._failed,
                refused=self._refused,
                parked=sum(len(v) for v in self._parked.values()),
                requests=len(self._requests),
            )

    # -- requests ------------------------------------------------------------------------------

    def on_new_request(self, ctx: ReqContext) -> None:
        with self._lock:
            if ctx.request_id in self._requests:
                raise OffloadError(f"request {ctx.request_id} is already registered")
            for tier in self._tiers:
                ctx.policies[tier.name] = tier.on_new_request(ctx).policy
            self._requests[ctx.request_id] = _RequestState(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        with self._lock:
            self._depth += 1
            try:
                state = self._state(ctx)
                state.finished = True
                for refs in state.load_refs.values():
                    for ref in refs:
                        ref.release()
                state.load_refs.clear()
                self._maybe_finish(state)
            finally:
                self._leave()

    def _state(self, ctx: ReqContext) -> _RequestState:
        state = self._requests.get(ctx.request_id)
        if state is None or state.ctx is not ctx:
            raise OffloadError(f"request {ctx.request_id} is not registered (on_new_request)")
        return state

    def _request_level(self, ctx: ReqContext) -> list[SecondaryTier]:
        return [t for t in self._tiers if ctx.policies.get(t.name) is OffloadPolicy.REQUEST_LEVEL]

    def _maybe_finish(self, state: _RequestState) -> None:
        drained = state.finished and not state.waiting and not state.own_writes
        if drained and self._requests.get(state.ctx.request_id) is state:
            del self._requests[state.ctx.request_id]
            self._outbox.finished(state.ctx)

    # -- load side -----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        result = self._pool.lookup(key)
        if result is not LookupResult.MISS:
            return result
        with self._lock:
            for tier in self._tiers:
                answer = tier.lookup(key, ctx)
                if answer is LookupResult.HIT:
                    tier.submit_load([key], ctx)
                    promoted = self._pool.lookup(key)
                    return LookupResult.RETRY if promoted is LookupResult.MISS else promoted
                if answer is not LookupResult.MISS:
                    return LookupResult.RETRY
        return LookupResult.MISS

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PageSpec:
        with self._lock:
            state = self._state(ctx)
            refs: list[PageRef] = []
            try:
                for key in keys:
                    refs.append(self._pool.acquire(key))
            except UnknownKey:
                for ref in refs:
                    ref.release()
                raise
            for ref in refs:
                state.load_refs.setdefault(ref.key, []).append(ref)
            return PageSpec(tuple(ref.index for ref in refs))

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        with self._lock:
            state = self._state(ctx)
            missing = [k for k in keys if not state.load_refs.get(k)]
            if missing:
                raise UnknownKey(f"{len(missing)} keys have no load pinned for {ctx.request_id}")
            for key in keys:
                refs = state.load_refs[key]
                refs.pop().release()
                if not refs:
                    del state.load_refs[key]

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        self._pool.touch(keys)

    # -- store side ----------------------------------------------------------------------------

    def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        *,
        cascade_only: Mapping[OffloadKey, StoreFailure] | None = None,
    ) -> PrepareStoreOutput:
        with self._lock:
            self._depth += 1
            try:
                return self._prepare_store(keys, ctx, cascade_only or {})
            finally:
                self._leave()

    def _prepare_store(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        cascade_only: Mapping[OffloadKey, StoreFailure],
    ) -> PrepareStoreOutput:
        state = self._state(ctx)
        if state.finished:
            raise OffloadError(f"prepare_store after on_request_finished for {ctx.request_id}")
        tiers = self._request_level(ctx)
        pool = self._pool
        seen: set[OffloadKey] = set()
        present: list[OffloadKey] = []
        cascade: list[OffloadKey] = []
        misses: list[OffloadKey] = []
        for key in (*keys, *cascade_only):
            if key in seen:
                continue
            seen.add(key)
            found = pool.lookup(key)
            new_offer = bool(tiers) and key not in state.offered
            if found is LookupResult.HIT:
                present.append(key)
                if new_offer:
                    state.offered.add(key)
                    cascade.append(key)
            elif found is LookupResult.HIT_PENDING:
                if new_offer:
                    state.offered.add(key)
                    self._park(tiers, state, key)
            elif key in cascade_only:
                if new_offer:
                    state.offered.add(key)
                    self._queue_failure(tiers, state, [key], cascade_only[key])
            else:
                misses.append(key)
        # Pin what cascades before allocating: the allocations below may evict.
        self._cascaded += len(tiers) * self._queue_store(tiers, state, cascade)
        pool.touch(present)  # most recently used, ahead of the evictions below
        allocations, refused = pool.allocate_many(misses, owner=ctx.request_id)
        for allocation in allocations:
            key = allocation.key
            state.own_writes.add(key)
            self._write_owner[key] = ctx.request_id
            if tiers and key not in state.offered:
                state.offered.add(key)
                self._park(tiers, state, key)
        if refused:
            self._refused += len(refused)
            fresh = [k for k in refused if k not in state.offered]
            state.offered.update(fresh)
            self._queue_failure(tiers, state, fresh, StoreFailure.POOL_EXHAUSTED)
            logger.warning(
                "request %s: host pool refused %d of %d keys to store",
                ctx.request_id,
                len(refused),
                len(misses),
            )
        return PrepareStoreOutput(
            keys_to_store=tuple(a.key for a in allocations),
            store_spec=PageSpec(tuple(a.index for a in allocations)),
            evicted_keys=tuple(k for a in allocations for k in a.evicted),
            refused_keys=tuple(refused),
        )

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool) -> None:
        if not keys:
            return
        with self._lock:
            self._depth += 1
            try:
                state = self._state(ctx)
                unknown = [k for k in keys if k not in state.own_writes]
                if unknown:
                    raise UnknownKey(
                        f"{len(unknown)} keys are not being written by {ctx.request_id}"
                    )
                self._pool.complete_writes(keys, success)  # → _on_write_done
            finally:
                self._leave()

    def _park(self, tiers: list[SecondaryTier], state: _RequestState, key: OffloadKey) -> None:
        self._parked.setdefault(key, []).append(state.ctx.request_id)
        state.waiting.add(key)
        self._outbox.pending(tiers, state.ctx, key)

    def _on_write_done(self, keys: tuple[OffloadKey, ...], success: bool) -> None:
        """Pool write listener: un-park waiters, write through, finish drained requests."""
        with self._lock:
            self._depth += 1
            try:
                unparked: dict[RequestId, list[OffloadKey]] = {}
                written: dict[RequestId, list[OffloadKey]] = {}
                for key in keys:
                    for rid in self._parked.pop(key, ()):
                        unparked.setdefault(rid, []).append(key)
                    owner = self._write_owner.pop(key, None)
                    if owner is not None:
                        written.setdefault(owner, []).append(key)
                touched: list[_RequestState] = []
                for rid, waited in unparked.items():
                    state = self._requests.get(rid)
                    if state is None:  # pragma: no cover - states leave only once drained
                        continue
                    touched.append(state)
                    state.waiting.difference_update(waited)
                    tiers = self._request_level(state.ctx)
                    if success:
                        self._unparked += len(tiers) * self._queue_store(tiers, state, waited)
                    else:
                        self._queue_failure(tiers, state, waited, StoreFailure.WRITE_FAILED)
                for rid, own in written.items():
                    state = self._requests.get(rid)
                    if state is None:  # pragma: no cover - states leave only once drained
                        continue
                    touched.append(state)
                    state.own_writes.difference_update(own)
                    if success:
                        self._write_through_keys(state, own)
                for state in touched:
                    self._maybe_finish(state)
            finally:
                self._leave()

    def _write_through_keys(self, state: _RequestState, keys: list[OffloadKey]) -> None:
        ctx = state.ctx
        for tier in self._tiers:
            if ctx.policies.get(tier.name) is OffloadPolicy.REQUEST_LEVEL:
                continue
            accepted = [k for k in keys if tier.accepts_store(k, ctx)]
            self._write_through += self._queue_store([tier], state, accepted)

    # -- deliveries ----------------------------------------------------------------------------

    def _queue_store(
        self, tiers: list[SecondaryTier], state: _RequestState, keys: list[OffloadKey]
    ) -> int:
        """Queue ``submit_store`` of ``keys`` (pinned until delivered); returns how many."""
        if not tiers or not keys:
            return 0
        pinned = self._pool.pin(keys)
        if len(pinned) != len(keys):  # evicted by another thread between completion and now
            gone = set(keys).difference(pinned)
            self._queue_failure(tiers, state, [k for k in keys if k in gone], StoreFailure.EVICTED)
        if not pinned:
            return 0
        self._outbox.pins.extend(pinned)
        self._outbox.store(tiers, state.ctx, pinned)
        return len(pinned)

    def _queue_failure(
        self,
        tiers: list[SecondaryTier],
        state: _RequestState,
        keys: list[OffloadKey],
        reason: StoreFailure,
    ) -> None:
        if not tiers or not keys:
            return
        self._outbox.failure(tiers, state.ctx, keys, reason)
        self._failed += len(tiers) * len(keys)

    def _leave(self) -> None:
        """End of a (possibly nested) call: the outermost one flushes the outbox."""
        self._depth -= 1
        if self._depth:
            return
        outbox, self._outbox = self._outbox, Outbox()
        try:
            outbox.deliver(self._tiers)
        finally:
            self._pool.unpin(outbox.pins)

    # -- events --------------------------------------------------------------------------------

    def take_events(self) -> list[OffloadEvent]:
        events = self._pool.take_events()
        for tier in self._tiers:
            events.extend(tier.take_events())
        return events
