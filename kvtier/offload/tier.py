"""The secondary tier interface: what a tier behind the primary host pool implements.

A tier (the P2P tier, a disk tier, a test recorder) plugs into
:class:`~kvtier.offload.tiering.TieringManager` without the manager knowing what it is. Whoever
builds the tier hands it the primary :class:`~kvtier.offload.pool.HostPagePool` if it reads or
writes page bytes.

Per request the manager calls, in order:

1. ``on_new_request(ctx)`` → :class:`RequestOffloadingContext`: the tier declares
   ``REQUEST_LEVEL`` (every chunk of the request) or ``BLOCK_LEVEL`` (write-through of newly
   stored chunks only).
2. Store side, for each key the request offers (``prepare_store``):

   - REQUEST_LEVEL: every offered key reaches the tier **exactly once**, by one of
     ``submit_store`` (the key is READABLE in the primary pool now: already resident, or its
     write — this request's or another's — just completed), or ``on_store_failed`` (it never
     will be: failed write, pool refusal, freed or out-of-window sliding-window chunk).
     Keys that will arrive later (a write in flight) are announced first with
     ``on_store_pending``, so the tier knows its full supply set early.
   - BLOCK_LEVEL: ``submit_store`` for keys this request newly wrote, after the write succeeded,
     if ``accepts_store(key, ctx)``.

3. Load side (``TieringManager.lookup`` on a primary ``MISS``): ``lookup(key, ctx)``; on ``HIT``
   the manager calls ``submit_load([key], ctx)`` and answers ``RETRY`` to the engine. The tier
   promotes the key into the primary pool itself: ``pool.allocate(key)``, fill
   ``pool.write_view(key)``, ``pool.complete_write(key, ok)``. Once the page is written the primary
   answers ``HIT``; a tier that can no longer deliver a key answers ``MISS`` from ``lookup``.
4. ``on_request_finished(ctx)``: only after every write this request waits on has drained (all
   its ``submit_store``/``on_store_failed`` calls have been made). No further store call for
   ``ctx`` follows; a tier may fail unmatched demand at once from here on.

Contract for ``submit_store``: the keys are READABLE during the call (the manager pins them for
its duration). A tier that needs a page to stay (e.g. until it is sent) must ``pool.acquire(key)``
(a :class:`~kvtier.offload.pool.PageRef` with a zero-copy view) or ``pool.pin(keys)`` (references
without views) *inside the call*, and give them back on every path later (``release``/``unpin``).
Callbacks run with the manager's lock held, on the thread that drove the event: they must be
quick and non-blocking (hand I/O to a loop, e.g. ``loop.call_soon_threadsafe``) and must not call
back into the manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvtier.keys import OffloadKey
from kvtier.offload.types import (
    LookupResult,
    OffloadEvent,
    ReqContext,
    RequestOffloadingContext,
    StoreFailure,
    TierName,
)


class SecondaryTier(ABC):
    """A tier behind the primary host pool. See the module docstring for the call protocol."""

    @property
    @abstractmethod
    def name(self) -> TierName:
        """Unique within a manager; keys ``ReqContext.policies`` and ``ReqContext.tier_state``."""

    @abstractmethod
    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        """Declare this tier's policy for ``ctx`` (may set up ``ctx.tier_state[self.name]``)."""

    def accepts_store(self, key: OffloadKey, ctx: ReqContext) -> bool:
        """Whether a BLOCK_LEVEL write-through of ``key`` for ``ctx`` is wanted (default: yes).

        A tier that only supplies REQUEST_LEVEL requests (the P2P tier) answers ``False``.
        Not consulted for REQUEST_LEVEL delivery, which is always complete.
        """
        return True

    @abstractmethod
    def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``keys`` are READABLE in the primary pool now; acquire references inside the call."""

    def on_store_pending(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """REQUEST_LEVEL only: ``keys`` are being written; each later gets ``submit_store`` or
        ``on_store_failed``. Default: nothing."""
        return

    def on_store_failed(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, reason: StoreFailure
    ) -> None:
        """REQUEST_LEVEL only: ``keys`` will never be supplied for ``ctx`` (fail their demand fast).

        Default: nothing.
        """
        return

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Load side, after a primary MISS: ``HIT`` if the tier can promote ``key`` (the manager
        then calls ``submit_load``), ``RETRY`` while a promotion is under way, ``MISS`` otherwise.
        Default: ``MISS``."""
        return LookupResult.MISS

    def submit_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027
        """Promote ``keys`` into the primary pool (allocate, write, ``complete_write``).

        Only called after ``lookup`` answered ``HIT``; the default tier never does.
        """

    @abstractmethod
    def on_request_finished(self, ctx: ReqContext) -> None:
        """The request is done and its pending writes drained; release its per-request state."""

    def take_events(self) -> list[OffloadEvent]:
        """Events of this tier's own medium since the last call. Default: none."""
        return []
