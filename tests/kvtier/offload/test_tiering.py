"""TieringManager scenarios: cascade, parking (vLLM #53062), failures, drain, loads (DESIGN §4)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from kvtier.errors import OffloadError, UnknownKey
from kvtier.keys import OffloadKey
from kvtier.offload import (
    MEDIUM_CPU,
    BytearrayPageBuffer,
    HostPagePool,
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestId,
    RequestOffloadingContext,
    SecondaryTier,
    StoreFailure,
    TieringManager,
    TierName,
)
from tests.kvtier.offload.recording_tier import PRODUCER, RecordingTier, block_level, key


@dataclass
class Stack:
    pool: HostPagePool
    p2p: RecordingTier
    disk: RecordingTier
    manager: TieringManager

    def request(self, rid: str, params: dict[str, object] | None = None) -> ReqContext:
        ctx = ReqContext(RequestId(rid), params)
        self.manager.on_new_request(ctx)
        return ctx

    def store(self, ctx: ReqContext, keys: Sequence[OffloadKey], *, ok: bool = True) -> None:
        out = self.manager.prepare_store(keys, ctx)
        self.copy(out.keys_to_store)
        self.manager.complete_store(out.keys_to_store, ctx, ok)

    def copy(self, keys: Sequence[OffloadKey]) -> None:
        """What the engine's GPU→host copy job does: fill the pages."""
        for k in keys:
            self.pool.write_view(k)[:] = k[:8]


def make_stack(pages: int = 64) -> Stack:
    pool = HostPagePool(BytearrayPageBuffer(pages, 8))
    # like the P2P tier: request-level supply only, no block-level write-through
    p2p = RecordingTier("p2p", pool, hold_refs=True, accepts=lambda k: False)
    disk = RecordingTier("disk", pool, policy=block_level)
    return Stack(pool, p2p, disk, TieringManager(pool, [p2p, disk]))


@pytest.fixture
def stack() -> Iterator[Stack]:
    s = make_stack()
    yield s
    assert s.p2p.violations == [] and s.disk.violations == []
    s.p2p.release_all()
    s.manager.close()


KEYS = [key(i) for i in range(8)]
NEW = [key(i) for i in range(8, 12)]


def test_on_new_request_records_policies(stack: Stack) -> None:
    producer = stack.request("p", PRODUCER)
    plain = stack.request("q")
    assert producer.policies == {
        TierName("p2p"): OffloadPolicy.REQUEST_LEVEL,
        TierName("disk"): OffloadPolicy.BLOCK_LEVEL,
    }
    assert producer.request_level_tiers == {TierName("p2p")} and producer.is_request_level
    assert not plain.is_request_level
    with pytest.raises(OffloadError):
        stack.manager.on_new_request(ReqContext(RequestId("p")))


@pytest.mark.parametrize("shape", ["fully_warm", "mixed"])
def test_request_level_cascade(stack: Stack, shape: str) -> None:
    warmer = stack.request("warmer")
    stack.store(warmer, KEYS)
    stack.manager.on_request_finished(warmer)
    assert stack.disk.rec("warmer").stored == KEYS  # write-through of new writes
    assert stack.p2p.rec("warmer").stored == []  # block-level for p2p: nothing cascades

    producer = stack.request("producer", PRODUCER)
    keys = KEYS if shape == "fully_warm" else KEYS + NEW
    out = stack.manager.prepare_store(keys, producer)
    rec = stack.p2p.rec("producer")
    assert rec.stored == KEYS  # old keys at once, no GPU copy
    if shape == "fully_warm":
        assert out.keys_to_store == ()  # I2: nothing copied GPU→host
        assert rec.pending == []
    else:
        assert out.keys_to_store == tuple(NEW)
        assert rec.pending == NEW
        stack.copy(out.keys_to_store)
        stack.manager.complete_store(out.keys_to_store, producer, True)
        assert rec.stored == KEYS + NEW  # new ones after their store completed
    stack.manager.on_request_finished(producer)
    assert rec.finished and rec.failed == {}
    expected_disk = [] if shape == "fully_warm" else NEW
    assert stack.disk.rec("producer").stored == expected_disk  # block-level: only new writes
    assert stack.manager.stats().cascaded == len(KEYS)


def test_block_level_request_never_cascades(stack: Stack) -> None:
    warmer = stack.request("warmer")
    stack.store(warmer, KEYS)
    plain = stack.request("plain")
    out = stack.manager.prepare_store(KEYS + NEW, plain)
    assert out.keys_to_store == tuple(NEW)
    stack.manager.complete_store(out.keys_to_store, plain, True)
    assert stack.p2p.rec("plain").stored == []
    assert stack.disk.rec("plain").stored == NEW


@pytest.mark.parametrize("finish_b_early", [False, True])
def test_in_flight_store_of_another_request_is_parked_and_cascaded(
    stack: Stack, finish_b_early: bool
) -> None:
    """vLLM #53062: A's store in flight, B's REQUEST_LEVEL prepare_store, A completes."""
    a = stack.request("a")
    out_a = stack.manager.prepare_store(KEYS, a)
    assert out_a.keys_to_store == tuple(KEYS)
    b = stack.request("b", PRODUCER)
    out_b = stack.manager.prepare_store(KEYS, b)
    assert out_b.keys_to_store == ()  # HIT_PENDING counts as present: no second copy
    rec = stack.p2p.rec("b")
    assert rec.stored == [] and rec.pending == KEYS
    assert stack.manager.stats().parked == len(KEYS)
    if finish_b_early:
        stack.manager.on_request_finished(b)
        assert not rec.finished  # waits for A's writes to drain
    stack.copy(out_a.keys_to_store)
    stack.manager.complete_store(out_a.keys_to_store, a, True)
    assert rec.stored == KEYS  # B's tier receives every key
    assert rec.failed == {}
    if not finish_b_early:
        stack.manager.on_request_finished(b)
    assert rec.finished and rec.events == ["pending", "store", "finished"]
    assert stack.manager.stats().parked == 0


def test_failed_in_flight_write_fails_parked_keys_explicitly(stack: Stack) -> None:
    a = stack.request("a")
    out_a = stack.manager.prepare_store(KEYS, a)
    b = stack.request("b", PRODUCER)
    stack.manager.prepare_store(KEYS, b)
    stack.manager.on_request_finished(b)
    half = len(KEYS) // 2
    stack.manager.complete_store(out_a.keys_to_store[:half], a, True)
    stack.manager.complete_store(out_a.keys_to_store[half:], a, False)
    rec = stack.p2p.rec("b")
    assert rec.stored == KEYS[:half]
    assert rec.failed == dict.fromkeys(KEYS[half:], StoreFailure.WRITE_FAILED)
    assert rec.finished and rec.events[-1] == "finished"
    assert stack.disk.rec("a").stored == KEYS[:half]  # write-through only of successful writes


def test_own_failed_write_is_reported(stack: Stack) -> None:
    p = stack.request("p", PRODUCER)
    out = stack.manager.prepare_store(KEYS, p)
    stack.manager.complete_store(out.keys_to_store, p, False)
    assert stack.p2p.rec("p").failed == dict.fromkeys(KEYS, StoreFailure.WRITE_FAILED)
    assert stack.pool.stats().free == stack.pool.num_pages


def test_request_finished_waits_for_own_writes(stack: Stack) -> None:
    p = stack.request("p", PRODUCER)
    out = stack.manager.prepare_store(KEYS, p)
    stack.manager.on_request_finished(p)
    assert not stack.p2p.rec("p").finished and not stack.disk.rec("p").finished
    stack.manager.complete_store(out.keys_to_store, p, True)
    assert stack.p2p.rec("p").finished and stack.disk.rec("p").finished
    assert stack.p2p.rec("p").stored == KEYS
    assert stack.manager.stats().requests == 0
    with pytest.raises(OffloadError):
        stack.manager.prepare_store(KEYS, p)


def test_write_finished_outside_the_manager_unparks(stack: Stack) -> None:
    """An incoming page (a P2P fetch writing straight into the pool) un-parks waiters too."""
    stack.pool.allocate(key(1))
    p = stack.request("p", PRODUCER)
    assert stack.manager.prepare_store([key(1)], p).keys_to_store == ()
    stack.pool.complete_write(key(1), True)
    assert stack.p2p.rec("p").stored == [key(1)]


def test_pool_exhaustion_refuses_and_reports() -> None:
    s = make_stack(pages=4)
    p = s.request("p", PRODUCER)
    keys = [key(i) for i in range(6)]
    out = s.manager.prepare_store(keys, p)
    assert out.keys_to_store == tuple(keys[:4])
    assert out.refused_keys == tuple(keys[4:])
    rec = s.p2p.rec("p")
    assert rec.failed == dict.fromkeys(keys[4:], StoreFailure.POOL_EXHAUSTED)
    assert s.pool.stats().refusals == 2 and s.manager.stats().refused == 2
    s.manager.complete_store(out.keys_to_store, p, True)
    # the p2p tier holds references on what it received: a new store cannot evict them
    q = s.request("q")
    out_q = s.manager.prepare_store([key(9)], q)
    assert out_q.keys_to_store == () and out_q.refused_keys == (key(9),)
    assert all(s.pool.lookup(k) is LookupResult.HIT for k in keys[:4])
    s.p2p.release_all()
    out_q = s.manager.prepare_store([key(9)], q)
    assert out_q.keys_to_store == (key(9),) and len(out_q.evicted_keys) == 1
    s.manager.complete_store(out_q.keys_to_store, q, True)
    s.manager.close()


def test_cascade_only_keys_cascade_when_present_else_fail(stack: Stack) -> None:
    warmer = stack.request("w")
    stack.store(warmer, [key(1)])
    p = stack.request("p", PRODUCER)
    out = stack.manager.prepare_store(
        [key(3)],
        p,
        cascade_only={key(1): StoreFailure.NOT_STORABLE, key(2): StoreFailure.OUT_OF_WINDOW},
    )
    assert out.keys_to_store == (key(3),)
    rec = stack.p2p.rec("p")
    assert rec.stored == [key(1)]
    assert rec.failed == {key(2): StoreFailure.OUT_OF_WINDOW}


def test_each_key_reaches_a_request_level_tier_once(stack: Stack) -> None:
    p = stack.request("p", PRODUCER)
    out1 = stack.manager.prepare_store(KEYS[:5], p)
    stack.manager.complete_store(out1.keys_to_store, p, True)
    out2 = stack.manager.prepare_store(KEYS + KEYS[:2], p)  # grows, with repeats
    assert out2.keys_to_store == tuple(KEYS[5:])
    stack.manager.complete_store(out2.keys_to_store, p, True)
    assert sorted(stack.p2p.rec("p").stored) == sorted(KEYS)


def test_load_pins_pages_until_complete(stack: Stack) -> None:
    w = stack.request("w")
    stack.store(w, KEYS[:2])
    c = stack.request("c")
    assert stack.manager.lookup(KEYS[0], c) is LookupResult.HIT
    spec = stack.manager.prepare_load(KEYS[:2], c)
    assert spec.page_indices == tuple(stack.pool.page_index(k) for k in KEYS[:2])
    assert stack.pool.refcount(KEYS[0]) == 1
    with pytest.raises(UnknownKey):
        stack.manager.prepare_load([KEYS[0], key(99)], c)  # all or nothing
    assert stack.pool.refcount(KEYS[0]) == 1
    stack.manager.complete_load(KEYS[:1], c)
    assert stack.pool.refcount(KEYS[0]) == 0
    with pytest.raises(UnknownKey):
        stack.manager.complete_load(KEYS[:1], c)
    stack.manager.on_request_finished(c)  # releases what is still pinned
    assert stack.pool.refcount(KEYS[1]) == 0


class PromotingTier(SecondaryTier):
    """A tier holding bytes elsewhere; promotes on demand, completing when told."""

    def __init__(self, pool: HostPagePool, remote: dict[OffloadKey, bytes]) -> None:
        self.pool = pool
        self.remote = remote
        self.loading: list[OffloadKey] = []

    @property
    def name(self) -> TierName:
        return TierName("remote")

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        return

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if key in self.loading:
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.remote else LookupResult.MISS

    def submit_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.loading.extend(keys)

    def land(self) -> None:
        for k in self.loading:
            self.pool.allocate(k)
            self.pool.write_view(k)[:] = self.remote[k]
            self.pool.complete_write(k, True)
        self.loading.clear()

    def on_request_finished(self, ctx: ReqContext) -> None:
        return


def test_lookup_promotes_from_a_secondary_tier() -> None:
    pool = HostPagePool(BytearrayPageBuffer(4, 8))
    remote = PromotingTier(pool, {key(1): b"12345678"})
    manager = TieringManager(pool, [remote])
    ctx = ReqContext(RequestId("c"))
    manager.on_new_request(ctx)
    assert manager.lookup(key(1), ctx) is LookupResult.RETRY
    assert remote.loading == [key(1)]
    assert manager.lookup(key(1), ctx) is LookupResult.RETRY  # promotion under way
    assert manager.lookup(key(2), ctx) is LookupResult.MISS
    remote.land()
    assert manager.lookup(key(1), ctx) is LookupResult.HIT
    spec = manager.prepare_load([key(1)], ctx)
    assert bytes(pool.buffer.page_view(spec.page_indices[0])) == b"12345678"
    manager.complete_load([key(1)], ctx)
    manager.on_request_finished(ctx)
    assert [e.removed for e in manager.take_events() if e.medium == MEDIUM_CPU] == [False]
    manager.close()


def test_unknown_request_and_foreign_writes_are_refused(stack: Stack) -> None:
    stray = ReqContext(RequestId("stray"))
    with pytest.raises(OffloadError):
        stack.manager.prepare_store(KEYS, stray)
    a = stack.request("a")
    b = stack.request("b")
    out = stack.manager.prepare_store(KEYS[:1], a)
    with pytest.raises(UnknownKey):
        stack.manager.complete_store(out.keys_to_store, b, True)
    stack.manager.complete_store(out.keys_to_store, a, True)


def test_a_failing_tier_does_not_break_delivery_to_others(caplog: pytest.LogCaptureFixture) -> None:
    pool = HostPagePool(BytearrayPageBuffer(8, 8))

    class Broken(RecordingTier):
        def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
            raise RuntimeError("boom")

    broken = Broken("broken", pool)
    good = RecordingTier("good", pool)
    manager = TieringManager(pool, [broken, good])
    ctx = ReqContext(RequestId("p"), PRODUCER)
    manager.on_new_request(ctx)
    out = manager.prepare_store(KEYS[:2], ctx)
    manager.complete_store(out.keys_to_store, ctx, True)
    manager.on_request_finished(ctx)
    assert good.rec("p").stored == KEYS[:2] and good.rec("p").finished
    assert broken.rec("p").finished
    assert "boom" in caplog.text
    assert pool.stats().referenced == 0  # delivery references released on every path
    manager.close()
