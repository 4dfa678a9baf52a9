"""Consumer side: fetched pages verified, then installed in arrival order.

A payload lands in the page its sink reserved (``FrameChannel.receive_blocks_into``, which
reports the pages each receive completed together). Where its tag is checked depends on the
cores this process may use (``P2PSettings.verify_thread``):

- **on a worker thread** (hosts with spare cores: the default from 4 CPUs), while the event loop
  receives the next payloads. A socket receive releases the GIL, and so does the MAC on recent
  ``cryptography`` releases (they run AEAD work on 2 KiB or more with the GIL released), so the
  MAC overlaps the receive on another core. Verification runs in batches: one at a time, each
  taking every page received since the previous batch started, so the hand-off costs one thread
  round trip per batch, not per page. A batch is committed on the loop as soon as its
  verification ends.
- **on the loop, the moment a receive completed its pages** (executor None: the default below 4
  CPUs), while they are still in the CPU cache; they are committed together when the batch they
  came in ends (:meth:`PendingInstalls.commit_verified`: a receive completes about one page, and
  a commit per page ran the pool's listeners per page). With no spare core the thread's MAC
  competes with the receive anyway, reads the pages from DRAM again and adds a hand-off per
  batch: in six alternating runs of ``loadtest.bench_p2p`` on 2 shared cores (256 MiB, paired
  medians against the raw socket of the same run) the thread measured cold 0.60x and warm
  0.61x, verifying on arrival 0.69x and 0.67x, at less CPU (1.43-1.68x the raw socket's, was
  1.51-1.74x); those runs had both ends in one process. With the producer in its own process
  (the benchmark's default since), 7 runs gave medians of cold 0.70x and warm 0.88x on the
  thread, 0.72x and 0.71x on the loop, each swinging ±0.15: the default is kept until a host
  with spare cores measures it. The loop is held for one receive's pages (about 512 KiB: one
  such page, ~25 µs).

Either way each verified run is committed in one :meth:`~kvtier.p2p.sink.BlockSink.commit`, so
pages of a producer that is still computing become readable as their batches arrive and the
pool's listeners run once per batch.

Invariant (I6): a reservation is committed (the page becomes readable) only after its payload
verified, in the order the pages arrived; a page that fails is aborted together with every page
after it, and :class:`~kvtier.errors.IntegrityError` ends the fetch there. :meth:`PendingInstalls.
settle` (any error, the deadline or cancellation) installs the pages received whole that verify
and aborts the rest, after the worker thread is done with them (never while it reads a page).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import IntegrityError
from kvtier.keys import OffloadKey
from kvtier.p2p.channel import UnverifiedPayload
from kvtier.p2p.sink import BlockSink, PageReservation

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Received:
    """A page whose payload is whole in its reservation, not yet verified."""

    key: OffloadKey
    reservation: PageReservation
    payload: UnverifiedPayload


@dataclass(frozen=True, slots=True)
class _Verdict:
    failed_at: int | None
    """Index in the batch of the first page that failed (None: all verified)."""
    reason: str = ""


def _verify_batch(batch: list[Received]) -> _Verdict:
    """Runs on the worker thread; stops at the first failure (later pages are aborted)."""
    for i, received in enumerate(batch):
        try:
            received.payload.verify()
        except IntegrityError as exc:
            return _Verdict(i, str(exc))
        except Exception as exc:  # a bug must not install the page, nor hang the fetch
            logger.exception("p2p page verification failed unexpectedly")
            return _Verdict(i, f"page verification failed: {type(exc).__name__}")
    return _Verdict(None)


class PendingInstalls:
    """Pages of one fetch that were received and are waiting for their verification."""

    def __init__(
        self,
        executor: concurrent.futures.Executor | None,
        sink: BlockSink,
        on_installed: Callable[[list[OffloadKey], int], None],
    ) -> None:
        """``executor``: where batches are verified (None: in :meth:`add`, on the loop).
        ``on_installed(keys, nbytes)``: called on the loop, in order, after each commit
        (``nbytes``: the committed payloads' total)."""
        self._executor = executor
        self._sink = sink
        self._on_installed = on_installed
        self._loop = asyncio.get_running_loop()
        self._queued: list[Received] = []
        self._uncommitted: list[Received] = []
        """Verified on the loop, not committed yet (only without an executor)."""
        self._batch: list[Received] = []
        self._running: concurrent.futures.Future[_Verdict] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._failure: IntegrityError | None = None

    @property
    def failure(self) -> IntegrityError | None:
        """Why a received page was refused (the first one), if one was."""
        return self._failure

    def add(self, pages: Sequence[Received]) -> None:
        """Queue received pages, in arrival order (their reservations are ours from here on).

        Raises the IntegrityError of an earlier page that failed (these are aborted then);
        without an executor, the pages are verified here (committed by
        :meth:`commit_verified`), and a page of theirs that fails raises at once, the pages
        verified before it committed.
        """
        if self._failure is not None:
            _abort(pages)
            raise self._failure
        if self._executor is None:
            landed = list(pages)
            verdict = _verify_batch(landed)
            self._uncommitted.extend(landed)
            if verdict.failed_at is not None:
                failed_at = len(self._uncommitted) - len(landed) + verdict.failed_at
                verified, self._uncommitted = self._uncommitted, []
                self._install(verified, _Verdict(failed_at, verdict.reason))
                assert self._failure is not None
                raise self._failure
            return
        self._queued.extend(pages)
        if self._running is None and self._queued:
            self._start()

    def commit_verified(self) -> None:
        """Commit the pages verified on the loop so far, in one step (the receiver calls this
        when a batch's payloads are in; with an executor, batches commit as they verify)."""
        verified, self._uncommitted = self._uncommitted, []
        self._install(verified, _Verdict(None))

    async def finish(self) -> None:
        """Wait until every queued page is verified and installed (IntegrityError at the first
        that fails: it and every later page are aborted)."""
        self.commit_verified()
        await self._idle.wait()
        if self._failure is not None:
            raise self._failure

    def settle(self) -> None:
        """Error paths (a transport error, the deadline, cancellation): install every page that
        was received whole and verifies, in order, and abort the rest from the first that does
        not. Synchronous: it waits for the batch on the worker thread (a few milliseconds at
        most) rather than leave pages a later caller cannot account for. Idempotent."""
        self.commit_verified()
        running, batch = self._running, self._batch
        queued = self._queued
        self._running, self._batch, self._queued = None, [], []
        self._idle.set()
        if running is None:
            self._install(queued, _verify_batch(queued) if self._failure is None else None)
            return
        verdict = _verdict_of(running, batch)
        self._install(batch, verdict)
        self._install(queued, _verify_batch(queued) if verdict.failed_at is None else None)

    def _start(self) -> None:
        self._batch, self._queued = self._queued, []
        self._idle.clear()
        assert self._executor is not None  # add() verifies in place without one
        try:
            running = self._executor.submit(_verify_batch, self._batch)
        except RuntimeError:  # the client was closed during this fetch: verify on the loop
            running = concurrent.futures.Future()
            running.set_result(_verify_batch(self._batch))
        self._running = running
        loop = self._loop

        def wake(_: concurrent.futures.Future[_Verdict]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._verified, running)

        running.add_done_callback(wake)

    def _verified(self, running: concurrent.futures.Future[_Verdict]) -> None:
        """On the loop, as soon as a batch's verification ended: install it, start the next."""
        if running is not self._running:
            return  # settled meanwhile
        batch = self._batch
        self._running, self._batch = None, []
        verdict = _verdict_of(running, batch)
        self._install(batch, verdict)
        if verdict.failed_at is not None:
            queued, self._queued = self._queued, []
            _abort(queued)
        if self._queued:
            self._start()
        else:
            self._idle.set()

    def _install(self, batch: list[Received], verdict: _Verdict | None) -> None:
        """Commit ``batch`` up to its first failure, abort the rest (all of it for None)."""
        good = (
            0 if verdict is None else len(batch) if verdict.failed_at is None else verdict.failed_at
        )
        if good > 0:
            verified = batch[:good]
            self._sink.commit([received.reservation for received in verified])
            self._on_installed(
                [received.key for received in verified],
                sum(len(received.payload.dest) for received in verified),
            )
        _abort(batch[good:])
        if verdict is not None and verdict.failed_at is not None and self._failure is None:
            self._failure = IntegrityError(verdict.reason)
            logger.debug("p2p fetch: %s", verdict.reason)


def _verdict_of(running: concurrent.futures.Future[_Verdict], batch: list[Received]) -> _Verdict:
    """The batch's verdict; verified here when its job never ran (it was cancelled)."""
    try:
        return running.result()
    except concurrent.futures.CancelledError:
        return _verify_batch(batch)


def _abort(batch: Sequence[Received]) -> None:
    for received in batch:
        received.reservation.abort()
