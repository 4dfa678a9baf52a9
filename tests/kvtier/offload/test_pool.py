"""The primary host page pool: states, references, LRU eviction, refusal (invariant I5)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import OffloadError, PoolExhausted, UnknownKey
from kvtier.keys import OffloadKey
from kvtier.offload import (
    MEDIUM_CPU,
    BytearrayPageBuffer,
    HostPagePool,
    LookupResult,
    OffloadEvent,
    PageRef,
    PageState,
)
from tests.kvtier.offload.recording_tier import key


def make_pool(pages: int = 4, nbytes: int = 8) -> HostPagePool:
    return HostPagePool(BytearrayPageBuffer(pages, nbytes))


def written(pool: HostPagePool, k: OffloadKey, fill: int = 0) -> int:
    idx = pool.allocate(k).index
    pool.write_view(k)[:] = bytes([fill]) * pool.page_nbytes
    pool.complete_write(k, True)
    return idx


def test_slot_life_cycle_and_lookup() -> None:
    pool = make_pool()
    k = key(1)
    assert pool.lookup(k) is LookupResult.MISS
    alloc = pool.allocate(k)
    assert pool.lookup(k) is LookupResult.HIT_PENDING
    assert pool.state(k) is PageState.WRITING
    pool.write_view(k)[:] = b"abcdefgh"
    pool.complete_write(k, True)
    assert pool.lookup(k) is LookupResult.HIT
    with pool.acquire(k) as ref:
        assert ref.index == alloc.index
        assert bytes(ref.view) == b"abcdefgh"
        assert ref.view.readonly
        assert pool.refcount(k) == 1
    assert pool.refcount(k) == 0
    assert pool.take_events() == [OffloadEvent((k,), MEDIUM_CPU, removed=False)]


def test_failed_write_frees_the_slot() -> None:
    pool = make_pool(pages=1)
    seen: list[tuple[tuple[OffloadKey, ...], bool]] = []
    pool.add_write_listener(lambda k, ok: seen.append((k, ok)))
    pool.allocate(key(1))
    pool.complete_write(key(1), False)
    assert pool.lookup(key(1)) is LookupResult.MISS
    assert seen == [((key(1),), False)]
    assert pool.stats().write_failures == 1
    assert pool.take_events() == []
    pool.allocate(key(2))  # the page is free again


def test_views_are_zero_copy_over_the_buffer() -> None:
    buf = BytearrayPageBuffer(2, 4)
    pool = HostPagePool(buf)
    idx = pool.allocate(key(1)).index
    pool.write_view(key(1))[:] = b"\x01\x02\x03\x04"
    assert bytes(buf.page_view(idx)) == b"\x01\x02\x03\x04"


def test_contract_errors() -> None:
    pool = make_pool()
    pool.allocate(key(1))
    with pytest.raises(OffloadError):
        pool.allocate(key(1))
    with pytest.raises(UnknownKey):
        pool.acquire(key(1))  # still being written
    with pytest.raises(UnknownKey):
        pool.complete_write(key(2), True)
    pool.complete_write(key(1), True)
    with pytest.raises(UnknownKey):
        pool.write_view(key(1))  # readable pages are not writable
    with pytest.raises(UnknownKey):
        pool.page_index(key(9))


def test_lru_evicts_least_recently_used_unreferenced_page() -> None:
    pool = make_pool(pages=3)
    for i in range(3):
        written(pool, key(i))
    pool.touch([key(0)])  # 1 is now the least recently used
    alloc = pool.allocate(key(3))
    assert alloc.evicted == (key(1),)
    assert pool.lookup(key(1)) is LookupResult.MISS
    assert OffloadEvent((key(1),), MEDIUM_CPU, removed=True) in pool.take_events()
    assert pool.stats().evictions == 1


def test_eviction_never_touches_referenced_or_in_flight_pages() -> None:
    pool = make_pool(pages=3)
    written(pool, key(0))
    written(pool, key(1))
    pool.allocate(key(2))  # in flight
    ref = pool.acquire(key(0))  # referenced (being read or sent)
    alloc = pool.allocate(key(3))
    assert alloc.evicted == (key(1),)
    with pytest.raises(PoolExhausted):
        pool.allocate(key(4))
    stats = pool.stats()
    assert (stats.refusals, stats.referenced, stats.writing) == (1, 1, 2)
    assert pool.lookup(key(0)) is LookupResult.HIT
    assert pool.lookup(key(2)) is LookupResult.HIT_PENDING
    ref.release()
    ref.release()  # idempotent
    assert pool.allocate(key(4)).evicted == (key(0),)


def test_exhaustion_refuses_cleanly_and_keeps_contents() -> None:
    pool = make_pool(pages=2, nbytes=4)
    written(pool, key(0), fill=7)
    ref = pool.acquire(key(0))
    pool.allocate(key(1))
    before = pool.stats()
    for _ in range(3):
        with pytest.raises(PoolExhausted):
            pool.allocate(key(5))
    after = pool.stats()
    assert after.refusals == before.refusals + 3
    assert (after.free, after.writing, after.readable) == (
        before.free,
        before.writing,
        before.readable,
    )
    assert bytes(ref.view) == b"\x07" * 4
    assert pool.lookup(key(5)) is LookupResult.MISS
    ref.release()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "ok", "fail", "acq", "rel", "touch"]), st.integers(0, 7)
        ),
        max_size=60,
    )
)
def test_random_operations_keep_referenced_and_writing_pages(ops: list[tuple[str, int]]) -> None:
    """Whatever the sequence, a referenced or in-flight page is never evicted and its bytes stay."""
    pool = make_pool(pages=3, nbytes=2)
    held: list[PageRef] = []
    for op, i in ops:
        k = key(i)
        state = pool.state(k)
        if op == "alloc" and state is None:
            protected = {r.key for r in held} | {
                key(j) for j in range(8) if pool.state(key(j)) is PageState.WRITING
            }
            try:
                alloc = pool.allocate(k)
            except PoolExhausted:
                assert pool.stats().free == 0
                continue
            assert not set(alloc.evicted) & protected
            pool.write_view(k)[:] = bytes([i, i])
        elif op in ("ok", "fail") and state is PageState.WRITING:
            pool.complete_write(k, op == "ok")
        elif op == "acq" and state is PageState.READABLE:
            held.append(pool.acquire(k))
        elif op == "rel" and held:
            held.pop(0).release()
        elif op == "touch":
            pool.touch([k])
        for ref in held:
            assert pool.state(ref.key) is PageState.READABLE
            idx = int.from_bytes(ref.key[:16], "big")
            assert bytes(ref.view) == bytes([idx, idx])
    for ref in held:
        ref.release()
    assert pool.stats().referenced == 0


def test_batch_allocation_completion_and_pins() -> None:
    pool = make_pool(pages=3)
    written(pool, key(0))
    allocations, refused = pool.allocate_many([key(1), key(2), key(3)])
    assert [a.key for a in allocations] == [key(1), key(2), key(3)]
    assert allocations[2].evicted == (key(0),) and refused == []
    assert pool.allocate_many([key(4)]) == ([], [key(4)])  # all three in flight
    with pytest.raises(OffloadError):
        pool.allocate_many([key(1)])
    with pytest.raises(UnknownKey):
        pool.complete_writes([key(1), key(9)], True)  # changes nothing
    assert pool.lookup(key(1)) is LookupResult.HIT_PENDING
    pool.complete_writes([key(1), key(2)], True)
    assert pool.take_events()[-1] == OffloadEvent((key(1), key(2)), MEDIUM_CPU, removed=False)
    assert pool.pin([key(1), key(3), key(7)]) == [key(1)]  # only readable keys are pinned
    pool.complete_writes([key(3)], False)
    assert pool.allocate(key(5)).evicted == ()  # the failed write freed its page
    pool.complete_write(key(5), True)
    assert pool.allocate(key(6)).evicted == (key(2),)  # key(1) is pinned
    pool.unpin([key(1)])
    with pytest.raises(OffloadError):
        pool.unpin([key(1)])
    assert pool.stats().referenced == 0
