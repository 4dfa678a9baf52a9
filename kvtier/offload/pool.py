"""The primary tier: a pool of fixed-size host pages keyed by offload key.

The pool manages slots, states, reader references and LRU order; the bytes live in a
:class:`PageBuffer` supplied by the caller: ``kvtier.pages.HostPages`` (a pinned uint8 torch
tensor when CUDA is present) in a worker, :class:`BytearrayPageBuffer` in pure-Python tests. This
module never imports torch.

Slot life cycle::

    allocate(key) ──▶ WRITING ──complete_write(ok)──▶ READABLE ──evict (LRU, refs == 0)──▶ free
                         └────complete_write(failed)──▶ free

- ``lookup``: ``HIT`` for READABLE, ``HIT_PENDING`` for WRITING, ``MISS`` otherwise.
- Readers (a load into GPU, a P2P sender) ``acquire`` a :class:`PageRef`; a referenced page is
  never evicted (invariant I5). WRITING pages are never evicted either.
- ``allocate`` evicts the least recently used unreferenced READABLE page when no slot is free,
  and raises :class:`~kvtier.errors.PoolExhausted` (counted in ``stats().refusals``) when none
  can be freed — the store is refused, never corrupted.
- Write listeners hear every write's outcome, whoever wrote it (an engine store or a P2P fetch):
  the tiering manager cascades parked keys from there.

Thread safety: every method takes an internal lock; write listeners are called *after* the lock
is released, on the thread that called ``complete_write``. Page bytes are read and written through
memoryviews without the lock (a reference or the WRITING state is what protects them).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType

from kvtier.errors import OffloadError, PoolExhausted, UnknownKey
from kvtier.keys import OffloadKey
from kvtier.offload.buffer import BytearrayPageBuffer, PageBuffer
from kvtier.offload.types import MEDIUM_CPU, LookupResult, Medium, OffloadEvent, RequestId

logger = logging.getLogger(__name__)

__all__ = [
    "BytearrayPageBuffer",
    "HostPagePool",
    "PageAllocation",
    "PageBuffer",
    "PageRef",
    "PageState",
    "PoolStats",
    "WriteListener",
]

WriteListener = Callable[[tuple[OffloadKey, ...], bool], None]
"""Called with ``(keys, success)`` when page writes complete or fail (one call per batch)."""


class PageState(enum.Enum):
    """State of an occupied slot."""

    WRITING = "writing"
    READABLE = "readable"


@dataclass(frozen=True, slots=True)
class PageAllocation:
    """A slot allocated for a write: its page index and the keys evicted to make room."""

    key: OffloadKey
    index: int
    evicted: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counters and gauges of a pool."""

    num_pages: int
    free: int
    writing: int
    readable: int
    referenced: int
    evictions: int
    refusals: int
    write_failures: int


@dataclass(slots=True)
class _Slot:
    index: int
    state: PageState
    owner: RequestId | None
    refs: int = 0


class PageRef:
    """A reader's reference on a READABLE page: the page is not evicted until released.

    ``view`` is a read-only zero-copy memoryview of the page (e.g. for ``sock_sendall``).
    ``release`` is idempotent; the reference is also a context manager.
    """

    __slots__ = ("_pool", "_released", "index", "key", "view")

    def __init__(self, pool: HostPagePool, key: OffloadKey, index: int, view: memoryview) -> None:
        self._pool = pool
        self._released = False
        self.key = key
        self.index = index
        self.view = view

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._pool._release(self.key)

    def __enter__(self) -> PageRef:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class HostPagePool:
    """Fixed-size host pages keyed by :data:`~kvtier.keys.OffloadKey` (the primary tier)."""

    def __init__(self, buffer: PageBuffer, *, medium: Medium = MEDIUM_CPU) -> None:
        self._buffer = buffer
        self._medium = medium
        self._lock = threading.Lock()
        self._slots: dict[OffloadKey, _Slot] = {}
        self._free: list[int] = list(range(buffer.num_pages - 1, -1, -1))
        # READABLE pages with no reference, least recently used first: the eviction candidates.
        self._lru: OrderedDict[OffloadKey, None] = OrderedDict()
        self._listeners: list[WriteListener] = []
        self._events: list[OffloadEvent] = []
        self._evictions = 0
        self._refusals = 0
        self._write_failures = 0

    # -- introspection -------------------------------------------------------------------------

    @property
    def buffer(self) -> PageBuffer:
        return self._buffer

    @property
    def num_pages(self) -> int:
        return self._buffer.num_pages

    @property
    def page_nbytes(self) -> int:
        return self._buffer.page_nbytes

    @property
    def medium(self) -> Medium:
        return self._medium

    def lookup(self, key: OffloadKey) -> LookupResult:
        """``HIT`` (readable), ``HIT_PENDING`` (write in flight) or ``MISS``."""
        slot = self._slots.get(key)
        if slot is None:
            return LookupResult.MISS
        return LookupResult.HIT if slot.state is PageState.READABLE else LookupResult.HIT_PENDING

    def state(self, key: OffloadKey) -> PageState | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.state

    def owner(self, key: OffloadKey) -> RequestId | None:
        """The request that allocated the page (``None`` if unknown or not present)."""
        slot = self._slots.get(key)
        return None if slot is None else slot.owner

    def page_index(self, key: OffloadKey) -> int:
        slot = self._slots.get(key)
        if slot is None:
            raise UnknownKey(key)
        return slot.index

    def refcount(self, key: OffloadKey) -> int:
        slot = self._slots.get(key)
        return 0 if slot is None else slot.refs

    def stats(self) -> PoolStats:
        with self._lock:
            writing = sum(1 for s in self._slots.values() if s.state is PageState.WRITING)
            return PoolStats(
                num_pages=self._buffer.num_pages,
                free=len(self._free),
                writing=writing,
                readable=len(self._slots) - writing,
                referenced=sum(1 for s in self._slots.values() if s.refs > 0),
                evictions=self._evictions,
                refusals=self._refusals,
                write_failures=self._write_failures,
            )

    # -- writes --------------------------------------------------------------------------------

    def allocate(self, key: OffloadKey, *, owner: RequestId | None = None) -> PageAllocation:
        """A WRITING slot for ``key``, evicting the LRU unreferenced READABLE page if needed.

        Raises :class:`OffloadError` if ``key`` is already present and :class:`PoolExhausted`
        (counted) when no page can be freed.
        """
        with self._lock:
            if key in self._slots:
                raise OffloadError(f"key {key.hex()} is already in the pool")
            victims: list[OffloadKey] = []
            allocation = self._allocate_locked(key, owner, victims)
            self._note_evictions(victims)
            if allocation is None:
                raise PoolExhausted(
                    f"all {self._buffer.num_pages} host pages are referenced or being written"
                )
            return allocation

    def allocate_many(
        self, keys: Sequence[OffloadKey], *, owner: RequestId | None = None
    ) -> tuple[list[PageAllocation], list[OffloadKey]]:
        """Allocate absent ``keys`` in order under one lock: ``(allocations, refused)``.

        Keys the pool cannot take are refused (each counted) instead of raising; keys already
        present raise :class:`OffloadError` before anything is allocated.
        """
        with self._lock:
            present = [k for k in keys if k in self._slots]
            if present or len(set(keys)) != len(keys):
                raise OffloadError(f"{len(present)} keys already in the pool or repeated")
            allocations: list[PageAllocation] = []
            refused: list[OffloadKey] = []
            victims: list[OffloadKey] = []
            for key in keys:
                allocation = self._allocate_locked(key, owner, victims)
                if allocation is None:
                    refused.append(key)
                else:
                    allocations.append(allocation)
            self._note_evictions(victims)
            return allocations, refused

    def _allocate_locked(
        self, key: OffloadKey, owner: RequestId | None, victims: list[OffloadKey]
    ) -> PageAllocation | None:
        evicted: tuple[OffloadKey, ...] = ()
        if not self._free:
            if not self._lru:
                self._refusals += 1
                return None
            victim, _ = self._lru.popitem(last=False)
            self._free.append(self._slots.pop(victim).index)
            victims.append(victim)
            evicted = (victim,)
        index = self._free.pop()
        self._slots[key] = _Slot(index=index, state=PageState.WRITING, owner=owner)
        return PageAllocation(key=key, index=index, evicted=evicted)

    def _note_evictions(self, victims: list[OffloadKey]) -> None:
        if victims:
            self._evictions += len(victims)
            self._events.append(OffloadEvent(tuple(victims), self._medium, removed=True))

    def write_view(self, key: OffloadKey) -> memoryview:
        """Writable view of a WRITING page (for the writer only: a copy job, ``recv_into``)."""
        slot = self._slots.get(key)
        if slot is None or slot.state is not PageState.WRITING:
            raise UnknownKey(key)
        return self._buffer.page_view(slot.index)

    def complete_write(self, key: OffloadKey, success: bool) -> None:
        """End one write; see :meth:`complete_writes`."""
        self.complete_writes((key,), success)

    def complete_writes(self, keys: Sequence[OffloadKey], success: bool) -> None:
        """End writes: READABLE (and one stored event) on success, slots freed on failure.

        Raises :class:`UnknownKey` (changing nothing) if a key is not being written. Write
        listeners are then called once with ``(keys, success)``.
        """
        batch = tuple(keys)
        if not batch:
            return
        with self._lock:
            slots = [self._slots.get(k) for k in batch]
            if any(s is None or s.state is not PageState.WRITING for s in slots) or len(
                set(batch)
            ) != len(batch):
                raise UnknownKey(f"{len(batch)} keys: not all are being written (or repeated)")
            if success:
                for key, slot in zip(batch, slots, strict=True):
                    assert slot is not None
                    slot.state = PageState.READABLE
                    self._lru[key] = None
                self._events.append(OffloadEvent(batch, self._medium, removed=False))
            else:
                for key, slot in zip(batch, slots, strict=True):
                    assert slot is not None
                    del self._slots[key]
                    self._free.append(slot.index)
                self._write_failures += len(batch)
            listeners = tuple(self._listeners)
        for listener in listeners:
            listener(batch, success)

    def add_write_listener(self, listener: WriteListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_write_listener(self, listener: WriteListener) -> None:
        with self._lock:
            self._listeners.remove(listener)

    # -- reads ---------------------------------------------------------------------------------

    def acquire(self, key: OffloadKey) -> PageRef:
        """A reference on a READABLE page; raises :class:`UnknownKey` otherwise."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or slot.state is not PageState.READABLE:
                raise UnknownKey(key)
            slot.refs += 1
            self._lru.pop(key, None)
            index = slot.index
        return PageRef(self, key, index, self._buffer.page_view(index).toreadonly())

    def _release(self, key: OffloadKey) -> None:
        self.unpin((key,))

    def pin(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """Take a reference on each READABLE key without a view (cheap, for batches); returns
        the keys pinned. Each must be given back with :meth:`unpin`."""
        pinned: list[OffloadKey] = []
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if slot is not None and slot.state is PageState.READABLE:
                    slot.refs += 1
                    self._lru.pop(key, None)
                    pinned.append(key)
        return pinned

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        """Give back references taken by :meth:`pin` or :meth:`acquire`."""
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if slot is None or slot.refs <= 0:
                    raise OffloadError(f"release of unreferenced page {key.hex()}")
                slot.refs -= 1
                if slot.refs == 0:
                    self._lru[key] = None  # most recently used

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark keys as recently used (unreferenced READABLE ones move to the LRU's end)."""
        with self._lock:
            for key in keys:
                if key in self._lru:
                    self._lru.move_to_end(key)

    def take_events(self) -> list[OffloadEvent]:
        """Stored/removed events since the last call (the caller publishes them)."""
        with self._lock:
            events, self._events = self._events, []
        return events
