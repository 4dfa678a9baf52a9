"""Producer-side supply: the pages registered under each ``kv_request_id``, and demand on them.

A producer request K is *opened* when it starts, receives keys as they become readable
(``supply``), as parked in-flight stores (``park``, then ``supply`` or ``fail`` when the store
completes), and is *finished* when the producer request ends. Demand (:meth:`SupplyRegistry.
acquire`) for a key:

- readable → served at once;
- parked (store in flight) → waits for the store, bounded by the caller's deadline;
- unknown while K is running → waits, bounded by the caller's deadline;
- unknown once K has finished, failed, or K released → answered at once with a reason.

Each supplied page is one reference (a :class:`SupplyPage`) that the registry releases when K is
released (``release``: the consumer's ``done``, anyone's ``release``, a consumer disconnect) or
its lease expires (``expire``). A page being sent holds an extra count, so release while a send
is in progress defers the page's release to the end of that send: a page is never unpinned while
it is read (I5).

Each supplied page carries its :class:`~kvtier.p2p.sealing.PageTag` under the registry's page
key (:attr:`SupplyRegistry.page_sealer`): given by the caller (the P2P tier caches one per page
write, so a page supplied again is not tagged again), or computed by :meth:`SupplyRegistry.supply`
on the calling thread. Sends reuse it: no fetch reads a page for its MAC.

The registry is thread-safe: the tiering manager may call it from an engine thread while the
server awaits demand on the event loop (waiters are woken with ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.keys import OffloadKey
from kvtier.p2p.frames import KvRequestId
from kvtier.p2p.sealing import PageSealer, PageTag

logger = logging.getLogger(__name__)


class SupplyPage(Protocol):
    """One reference on a readable host page holding one key's payload."""

    def view(self) -> memoryview:
        """The payload bytes (1-D, format 'B'); valid until :meth:`release`."""
        ...

    def release(self) -> None:
        """Drop this reference (called exactly once by the registry)."""
        ...


@dataclass(slots=True)
class _Key:
    page: SupplyPage | None = None
    tag: PageTag | None = None
    failed: str | None = None
    senders: int = 0
    dropped: bool = False


@dataclass(slots=True)
class _Supply:
    kv_request_id: KvRequestId
    lease_deadline: float
    keys: dict[OffloadKey, _Key] = field(default_factory=dict)
    finished: bool = False
    lease_s: float | None = None
    """This supply's own lease (an offer's short one); None: the registry's."""


_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class SendHold:
    """A page lent to one send: ``view`` stays valid until :meth:`close`; ``tag`` is its MAC
    under the registry's page key."""

    __slots__ = ("_closed", "_registry", "_state", "tag", "view")

    def __init__(
        self, registry: SupplyRegistry, state: _Key, view: memoryview, tag: PageTag | None
    ) -> None:
        self._registry = registry
        self._state = state
        self.view = view
        self.tag = tag
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._registry._end_send(self._state)


@dataclass(frozen=True, slots=True)
class SupplyStats:
    requests: int
    running: int
    held_pages: int
    sending: int
    """Pages pinned by a send right now."""


class SupplyRegistry:
    """Supply per kv_request_id with page references, leases, and bounded demand."""

    def __init__(
        self,
        lease_s: float,
        *,
        released_memory: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[KvRequestId, _Supply] = {}
        self._released: OrderedDict[KvRequestId, str] = OrderedDict()
        self._released_memory = released_memory
        self._waiters: dict[KvRequestId, list[_Waiter]] = {}
        self._closed = False
        self.page_sealer = PageSealer()
        """This producer's page key (random, per registry); the server hands it to each
        authenticated session."""

    # ---- producer side (any thread) ---------------------------------------------------------

    def open(self, kv_request_id: KvRequestId, *, lease_s: float | None = None) -> None:
        """K started on the producer: demand for its keys now waits instead of failing.

        A K released before it opened (the proxy's release raced ahead of the producer leg)
        stays released: nothing is registered for it, so no page is held until a lease ends.
        ``lease_s``: K's own lease instead of the registry's (a supply opened by an offer).
        """
        with self._lock:
            if self._closed or kv_request_id in self._released:
                return
            if kv_request_id not in self._requests:
                lease = self._lease_s if lease_s is None else lease_s
                self._requests[kv_request_id] = _Supply(
                    kv_request_id, self._clock() + lease, lease_s=lease_s
                )
            self._wake(kv_request_id)

    def supply(
        self,
        kv_request_id: KvRequestId,
        key: OffloadKey,
        page: SupplyPage,
        tag: PageTag | None = None,
    ) -> bool:
        """Register a readable page for K, taking over the reference. False: not kept (K not
        open, released, or the key is already supplied) and ``page`` was released.

        ``tag``: the page's tag under :attr:`page_sealer` (cached by the caller); without one it
        is computed here, once, before the page becomes servable.
        """
        if tag is None and self.is_open(kv_request_id):
            tag = self.page_sealer.tag(page.view())
        with self._lock:
            entry = self._requests.get(kv_request_id)
            state = entry.keys.get(key) if entry is not None else None
            if entry is None or (state is not None and state.page is not None):
                keep = False
            else:
                entry.keys[key] = _Key(page=page, tag=tag)
                entry.lease_deadline = max(entry.lease_deadline, self._clock() + self._lease(entry))
                self._wake(kv_request_id)
                keep = True
        if not keep:
            page.release()
        return keep

    def park(self, kv_request_id: KvRequestId, key: OffloadKey) -> None:
        """``key``'s store is in flight: demand waits for it even after K finishes."""
        with self._lock:
            entry = self._requests.get(kv_request_id)
            if entry is not None and key not in entry.keys:
                entry.keys[key] = _Key()

    def fail(self, kv_request_id: KvRequestId, key: OffloadKey, reason: str) -> None:
        """``key`` will never be readable (its store failed): demand for it fails at once."""
        with self._lock:
            entry = self._requests.get(kv_request_id)
            if entry is None:
                return
            state = entry.keys.get(key)
            if state is None:
                entry.keys[key] = _Key(failed=reason)
            elif state.page is None:
                state.failed = reason
            self._wake(kv_request_id)

    def finish(self, kv_request_id: KvRequestId) -> None:
        """The producer request ended: unmet demand now fails at once; the lease starts."""
        with self._lock:
            entry = self._requests.get(kv_request_id)
            if entry is None:
                return
            entry.finished = True
            entry.lease_deadline = self._clock() + self._lease(entry)
            self._wake(kv_request_id)

    def release(self, kv_request_id: KvRequestId, reason: str) -> bool:
        """Drop K's supply and its page references. False when K held nothing (it is still
        remembered as released, so a later ``open`` of K registers nothing)."""
        with self._lock:
            entry = self._requests.pop(kv_request_id, None)
            self._remember_released(kv_request_id, reason)
            if entry is None:
                return False
            pages = self._detach(entry)
            self._wake(kv_request_id)
        for page in pages:
            page.release()
        logger.debug("p2p supply %s released (%s)", kv_request_id, reason)
        return True

    def expire(self) -> list[KvRequestId]:
        """Release every K whose lease has passed; returns them."""
        now = self._clock()
        with self._lock:
            expired = [k for k, e in self._requests.items() if e.lease_deadline <= now]
        for kv_request_id in expired:
            if self.release(kv_request_id, "lease expired"):
                logger.info("p2p supply %s lease expired", kv_request_id)
        return expired

    def close(self) -> None:
        """Release everything; later registrations are ignored (their pages released)."""
        with self._lock:
            self._closed = True
            ids = list(self._requests)
        for kv_request_id in ids:
            self.release(kv_request_id, "producer shutting down")

    # ---- introspection -----------------------------------------------------------------------

    def stats(self) -> SupplyStats:
        with self._lock:
            held = sending = 0
            for entry in self._requests.values():
                for state in entry.keys.values():
                    held += state.page is not None
                    sending += state.senders
            running = sum(not e.finished for e in self._requests.values())
            return SupplyStats(len(self._requests), running, held, sending)

    def keys_of(self, kv_request_id: KvRequestId) -> list[OffloadKey]:
        """Keys readable now under K (for the producer's answer and for tests)."""
        with self._lock:
            entry = self._requests.get(kv_request_id)
            if entry is None:
                return []
            return [k for k, s in entry.keys.items() if s.page is not None]

    def is_open(self, kv_request_id: KvRequestId) -> bool:
        with self._lock:
            return kv_request_id in self._requests

    # ---- demand side (event loop) -----------------------------------------------------------

    async def acquire(
        self, kv_request_id: KvRequestId, key: OffloadKey, deadline: float, unknown_until: float
    ) -> SendHold | str:
        """A hold on ``key``'s page, or the reason it cannot be served.

        ``deadline`` and ``unknown_until`` are ``loop.time()`` values: the longest wait for the
        key, and for K itself to be registered.
        """
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                answer = self._answer(kv_request_id, key, loop.time(), unknown_until)
                if answer is not None:
                    return answer
                if loop.time() >= deadline:
                    return "deadline passed while the key was not yet readable"
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.setdefault(kv_request_id, []).append((loop, fut))
                registered = kv_request_id in self._requests
            until = deadline if registered else min(deadline, unknown_until)
            try:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(until - loop.time(), 0)):
                        await fut
            finally:
                self._forget_waiter(kv_request_id, fut)

    def acquire_readable(self, kv_request_id: KvRequestId, key: OffloadKey) -> SendHold | None:
        """A hold on ``key``'s page when it is readable now; None otherwise (whatever the
        reason: :meth:`acquire` tells it). Lets a sender batch the pages that are ready."""
        with self._lock:
            entry = self._requests.get(kv_request_id)
            state = None if entry is None else entry.keys.get(key)
            if state is None or state.page is None:
                return None
            return self._hold(state, state.page)

    def _answer(
        self, kv_request_id: KvRequestId, key: OffloadKey, now: float, unknown_until: float
    ) -> SendHold | str | None:
        entry = self._requests.get(kv_request_id)
        if entry is None:
            if kv_request_id in self._released:
                return f"supply released ({self._released[kv_request_id]})"
            if self._closed:
                return "producer shutting down"
            if now >= unknown_until:
                return "unknown kv_request_id"
            return None
        state = entry.keys.get(key)
        if state is not None and state.page is not None:
            return self._hold(state, state.page)
        if state is not None and state.failed is not None:
            return f"store failed: {state.failed}"
        if state is None and entry.finished:
            return "not in supply (producer request finished)"
        return None

    def _hold(self, state: _Key, page: SupplyPage) -> SendHold:
        state.senders += 1
        try:
            return SendHold(self, state, page.view(), state.tag)
        except Exception:
            state.senders -= 1
            raise

    def _end_send(self, state: _Key) -> None:
        page = None
        with self._lock:
            state.senders -= 1
            if state.dropped and state.senders == 0 and state.page is not None:
                page, state.page = state.page, None
        if page is not None:
            page.release()

    # ---- internals (lock held) --------------------------------------------------------------

    def _lease(self, entry: _Supply) -> float:
        return self._lease_s if entry.lease_s is None else entry.lease_s

    def _detach(self, entry: _Supply) -> list[SupplyPage]:
        pages = []
        for state in entry.keys.values():
            state.dropped = True
            if state.page is not None and state.senders == 0:
                pages.append(state.page)
                state.page = None
        return pages

    def _remember_released(self, kv_request_id: KvRequestId, reason: str) -> None:
        self._released[kv_request_id] = reason
        while len(self._released) > self._released_memory:
            self._released.popitem(last=False)

    def _wake(self, kv_request_id: KvRequestId) -> None:
        for loop, fut in self._waiters.pop(kv_request_id, ()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)

    def _forget_waiter(self, kv_request_id: KvRequestId, fut: asyncio.Future[None]) -> None:
        with self._lock:
            waiters = self._waiters.get(kv_request_id)
            if waiters is None:
                return
            waiters[:] = [w for w in waiters if w[1] is not fut]
            if not waiters:
                del self._waiters[kv_request_id]


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
