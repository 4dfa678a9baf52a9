"""Consumer installs: verified pages are committed one batch at a time, in arrival order.

On a verify thread, a held-back executor (a fake: it runs a submitted verification only when
the test says so) makes the batches deterministic: pages that arrive while a batch is being
verified form the next batch, and each batch reaches the pool in one ``complete_writes`` (one
listener call). Without an executor, each receive's pages are verified at once and committed
when their batch ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest

from kvtier.errors import IntegrityError
from kvtier.keys import OffloadKey
from kvtier.offload.pool import BytearrayPageBuffer, HostPagePool
from kvtier.offload.types import LookupResult
from kvtier.p2p import PoolSink
from kvtier.p2p.channel import UnverifiedPayload
from kvtier.p2p.installs import PendingInstalls, Received
from kvtier.p2p.sealing import PageOpener, PageSealer
from kvtier.p2p.sink import AlreadyHeld

from .conftest import PAGE, make_keys, payload


class HeldBackExecutor(concurrent.futures.Executor):
    """Runs each submitted job only when :meth:`run_next` is called (in submission order)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[concurrent.futures.Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.jobs.append((future, lambda: fn(*args, **kwargs)))
        return future

    def run_next(self) -> None:
        future, job = self.jobs.pop(0)
        future.set_result(job())


class Consumer:
    """A pool, its sink, the commits its write listener saw, and pages to receive."""

    def __init__(self) -> None:
        self.pool = HostPagePool(BytearrayPageBuffer(8, PAGE))
        self.sink = PoolSink(self.pool)
        self.commits: list[tuple[tuple[OffloadKey, ...], bool]] = []
        self.pool.add_write_listener(lambda keys, ok: self.commits.append((tuple(keys), ok)))
        self.sealer = PageSealer()
        self.opener = PageOpener(self.sealer.key)
        self.installed: list[OffloadKey] = []
        self.nbytes = 0

    def on_installed(self, keys: list[OffloadKey], nbytes: int) -> None:
        self.installed.extend(keys)
        self.nbytes += nbytes

    def received(self, key: OffloadKey, *, forged: bool = False) -> Received:
        """``key``'s page received whole into its reservation (``forged``: one byte flipped
        after the producer tagged it)."""
        reservation = self.sink.reserve(key, PAGE)
        assert reservation is not None and not isinstance(reservation, AlreadyHeld)
        data = bytearray(payload(key))
        tag = self.sealer.tag(data)
        if forged:
            data[100] ^= 1
        reservation.buffer[:] = data
        return Received(key, reservation, UnverifiedPayload(self.opener, reservation.buffer, tag))


async def _settled() -> None:
    for _ in range(3):  # the verdict's hand-off to the loop
        await asyncio.sleep(0)


async def test_pages_received_during_a_verification_are_committed_as_one_batch() -> None:
    consumer = Consumer()
    executor = HeldBackExecutor()
    installs = PendingInstalls(executor, consumer.sink, consumer.on_installed)
    keys = make_keys(4)
    installs.add([consumer.received(keys[0])])
    installs.add([consumer.received(keys[1]), consumer.received(keys[2])])
    installs.add([consumer.received(keys[3])])
    assert consumer.commits == []  # nothing readable before it verified
    assert all(consumer.pool.lookup(k) is LookupResult.HIT_PENDING for k in keys)

    executor.run_next()  # the first batch: the page that started it
    await _settled()
    executor.run_next()  # the second: every page that came meanwhile
    await installs.finish()

    assert consumer.commits == [((keys[0],), True), (tuple(keys[1:]), True)]
    assert consumer.installed == keys and consumer.nbytes == 4 * PAGE
    assert all(consumer.pool.lookup(k) is LookupResult.HIT for k in keys)
    ref = consumer.pool.acquire(keys[2])
    assert bytes(ref.view) == payload(keys[2])
    ref.release()


def _assert_forged_third_page(
    consumer: Consumer, installs: PendingInstalls, keys: list[OffloadKey]
) -> None:
    """keys[2] was forged: the two before it are installed, it and keys[3] aborted, and a page
    received after the failure is aborted, never queued."""
    assert consumer.commits == [
        ((keys[0],), True),
        ((keys[1],), True),
        ((keys[2],), False),
        ((keys[3],), False),
    ]
    assert consumer.installed == keys[:2]
    assert consumer.pool.lookup(keys[2]) is LookupResult.MISS
    assert consumer.pool.lookup(keys[3]) is LookupResult.MISS
    late = consumer.received(make_keys(1, start=100)[0])
    with pytest.raises(IntegrityError):
        installs.add([late])
    assert consumer.pool.lookup(late.key) is LookupResult.MISS


async def test_a_forged_page_commits_the_verified_prefix_of_its_batch_and_aborts_the_rest() -> None:
    consumer = Consumer()
    executor = HeldBackExecutor()
    installs = PendingInstalls(executor, consumer.sink, consumer.on_installed)
    keys = make_keys(4)
    installs.add([consumer.received(keys[0])])
    installs.add(
        [
            consumer.received(keys[1]),
            consumer.received(keys[2], forged=True),
            consumer.received(keys[3]),
        ]
    )
    executor.run_next()
    await _settled()
    executor.run_next()
    with pytest.raises(IntegrityError):
        await installs.finish()
    _assert_forged_third_page(consumer, installs, keys)


async def test_without_an_executor_pages_verify_as_they_land_and_commit_per_batch() -> None:
    consumer = Consumer()
    installs = PendingInstalls(None, consumer.sink, consumer.on_installed)
    keys = make_keys(5)
    first, second = [consumer.received(keys[0])], [consumer.received(keys[1])]
    later = [consumer.received(k) for k in keys[2:]]
    installs.add(first)
    installs.add(second)
    assert consumer.commits == []  # verified, not readable until its batch is in
    assert all(consumer.pool.lookup(k) is LookupResult.HIT_PENDING for k in keys)
    installs.commit_verified()  # the receiver: the batch's payloads are all in
    assert consumer.commits == [((keys[0], keys[1]), True)]
    assert consumer.pool.lookup(keys[2]) is LookupResult.HIT_PENDING  # not received yet
    installs.add(later)
    await installs.finish()  # commits what the last batch verified

    assert consumer.commits == [((keys[0], keys[1]), True), (tuple(keys[2:]), True)]
    assert consumer.installed == keys and consumer.nbytes == 5 * PAGE
    ref = consumer.pool.acquire(keys[3])
    assert bytes(ref.view) == payload(keys[3])
    ref.release()


async def test_without_an_executor_settle_commits_the_pages_already_verified() -> None:
    consumer = Consumer()
    installs = PendingInstalls(None, consumer.sink, consumer.on_installed)
    keys = make_keys(2)
    installs.add([consumer.received(k) for k in keys])
    installs.settle()  # the connection broke before the batch ended: they are whole and verified
    assert consumer.commits == [(tuple(keys), True)]
    assert consumer.installed == keys


async def test_without_an_executor_a_forged_page_raises_in_its_receive() -> None:
    consumer = Consumer()
    installs = PendingInstalls(None, consumer.sink, consumer.on_installed)
    keys = make_keys(4)
    installs.add([consumer.received(keys[0])])
    installs.commit_verified()  # the first batch ended
    pages = [
        consumer.received(keys[1]),
        consumer.received(keys[2], forged=True),
        consumer.received(keys[3]),
    ]
    with pytest.raises(IntegrityError):  # at once: the fetch stops receiving there
        installs.add(pages)
    installs.settle()  # the receiver's error path: nothing left to install or abort
    with pytest.raises(IntegrityError):
        await installs.finish()
    _assert_forged_third_page(consumer, installs, keys)


def test_a_sink_commits_only_its_own_reservations() -> None:
    consumer, other = Consumer(), Consumer()
    key = make_keys(1)[0]
    foreign = other.received(key)
    with pytest.raises(TypeError):
        consumer.sink.commit([foreign.reservation])
    assert other.pool.lookup(key) is LookupResult.HIT_PENDING
    other.sink.commit([foreign.reservation, foreign.reservation])  # the repeat is skipped
    assert other.commits == [((key,), True)]
    foreign.reservation.abort()  # after the commit: changes nothing
    assert other.pool.lookup(key) is LookupResult.HIT
