"""Adapters between the primary :class:`~kvtier.offload.pool.HostPagePool` and the transport.

- :class:`PoolSupplyPage`: a producer's :class:`~kvtier.offload.pool.PageRef` as a
  :class:`~kvtier.p2p.supply.SupplyPage` (the payload is the first ``nbytes`` of the page).
- :class:`PoolSink`: a consumer's pool as a :class:`~kvtier.p2p.sink.BlockSink`: a fetched
  block is written into a page allocated for its key (``allocate`` → ``write_view`` →
  ``complete_writes``, one call per verified batch), so the tiering manager sees it as a
  normal write (listeners, events).
  A key present by the time its block comes (installed meanwhile by a concurrent fetch or a
  local store, readable or still being written by that writer) is answered
  :data:`~kvtier.p2p.sink.ALREADY_HELD`: the client skips the payload and the key stays
  usable. Its readability is then up to that writer; a write that fails leaves the key absent,
  as any later eviction would, and a caller reads the pool before it relies on a key. Only a
  pool with no page to free refuses a block.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.errors import OffloadError, PoolExhausted
from kvtier.keys import OffloadKey
from kvtier.offload.pool import HostPagePool, PageRef
from kvtier.offload.types import LookupResult, RequestId
from kvtier.p2p.sink import ALREADY_HELD, AlreadyHeld, PageReservation

logger = logging.getLogger(__name__)


class PoolSupplyPage:
    """One pool reference lent to the supply registry (released exactly once by it)."""

    __slots__ = ("_nbytes", "_ref")

    def __init__(self, ref: PageRef, nbytes: int) -> None:
        if nbytes > len(ref.view):
            raise ValueError(f"payload of {nbytes} bytes exceeds the {len(ref.view)}-byte page")
        self._ref = ref
        self._nbytes = nbytes

    def view(self) -> memoryview:
        return self._ref.view[: self._nbytes]

    def release(self) -> None:
        self._ref.release()


class _PoolReservation:
    __slots__ = ("_done", "_key", "_pool", "buffer")

    def __init__(self, pool: HostPagePool, key: OffloadKey, nbytes: int) -> None:
        self._pool = pool
        self._key = key
        self._done = False
        self.buffer = pool.write_view(key)[:nbytes]

    @property
    def pool(self) -> HostPagePool:
        return self._pool

    @property
    def key(self) -> OffloadKey:
        return self._key

    def settle(self) -> bool:
        """Mark the write ended; True when it was still open (the caller ends it in the pool)."""
        open_, self._done = not self._done, True
        return open_

    def abort(self) -> None:
        if self.settle():
            self._pool.complete_write(self._key, False)


class PoolSink:
    """Install fetched blocks into a consumer's primary host pool."""

    def __init__(self, pool: HostPagePool, *, owner: RequestId | None = None) -> None:
        self.pool = pool
        self.owner = owner

    def holds(self, key: OffloadKey) -> bool:
        return self.pool.lookup(key) is not LookupResult.MISS

    def reserve(self, key: OffloadKey, nbytes: int) -> _PoolReservation | AlreadyHeld | None:
        if nbytes > self.pool.page_nbytes:
            logger.warning(
                "p2p block of %d bytes does not fit a %d-byte host page",
                nbytes,
                self.pool.page_nbytes,
            )
            return None
        if self.holds(key):
            return ALREADY_HELD
        try:
            self.pool.allocate(key, owner=self.owner)
        except PoolExhausted as exc:
            logger.info("p2p cannot install %s: %s", key.hex(), exc)
            return None
        except OffloadError:  # written meanwhile from another thread (a local store)
            return ALREADY_HELD
        return _PoolReservation(self.pool, key, nbytes)

    def commit(self, reservations: Sequence[PageReservation]) -> None:
        """One ``complete_writes`` for the batch: the pool's listeners (the tiering manager's
        cascade) and its stored event run once per verified batch, not once per page."""
        keys = []
        for reservation in reservations:
            if not isinstance(reservation, _PoolReservation) or reservation.pool is not self.pool:
                raise TypeError("a reservation this sink did not make")
            if reservation.settle():
                keys.append(reservation.key)
        self.pool.complete_writes(keys, True)
