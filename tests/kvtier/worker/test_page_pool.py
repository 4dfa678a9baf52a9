"""Page pool: reference counts, prefix-cache map, LRU of free cached pages, exhaustion."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import PoolExhausted
from kvtier.keys import BlockHash
from kvtier.worker.kv_layout import KVGroupSpec
from kvtier.worker.page_pool import PagePool

SPEC = KVGroupSpec(0, (0,), None, (2, 4), torch.float32)


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def test_cached_pages_survive_release_and_are_evicted_least_recently_freed_first() -> None:
    removed: list[BlockHash] = []
    pool = PagePool(SPEC, 3, torch.device("cpu"), on_removed=lambda g, hs: removed.extend(hs))
    pages = [pool.allocate() for _ in range(3)]
    for i, page in enumerate(pages):
        assert pool.register(page, h(i))
    for page in (pages[1], pages[0], pages[2]):  # freed in this order
        pool.release(page)
    assert pool.num_free == 3 and pool.num_cached == 3
    assert pool.lookup(h(0)) == pages[0]
    pool.acquire(pages[1])  # a prefix hit takes page 1 off the LRU
    first = pool.allocate()
    assert first == pages[0] and removed == [h(0)]  # least recently freed of the free ones
    assert pool.lookup(h(0)) is None and pool.lookup(h(1)) == pages[1]
    second = pool.allocate()
    assert second == pages[2] and removed == [h(0), h(2)]
    with pytest.raises(PoolExhausted):
        pool.allocate()
    assert pool.evictions == 2


def test_register_refuses_a_second_page_for_one_hash() -> None:
    pool = PagePool(SPEC, 2, torch.device("cpu"))
    a, b = pool.allocate(), pool.allocate()
    assert pool.register(a, h(1))
    assert not pool.register(b, h(1))
    pool.release(b)
    assert pool.num_cached == 1 and pool.lookup(h(1)) == a


def test_release_below_zero_is_an_error() -> None:
    pool = PagePool(SPEC, 1, torch.device("cpu"))
    page = pool.allocate()
    pool.release(page)
    with pytest.raises(ValueError):
        pool.release(page)


def test_page_bytes_round_trip() -> None:
    pool = PagePool(SPEC, 2, torch.device("cpu"))
    page = pool.allocate()
    data = bytes(range(SPEC.page_nbytes))
    pool.write_page_bytes(page, data)
    assert bytes(pool.page_bytes(page).numpy()) == data
    with pytest.raises(ValueError):
        pool.write_page_bytes(page, b"short")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "hit"]), st.integers(0, 7))))
def test_accounting_invariants_hold_for_any_sequence(ops: list[tuple[str, int]]) -> None:
    pool = PagePool(SPEC, 4, torch.device("cpu"))
    held: list[int] = []
    for op, arg in ops:
        if op == "alloc":
            try:
                page = pool.allocate()
            except PoolExhausted:
                assert pool.num_free == 0
                continue
            pool.register(page, h(arg))
            held.append(page)
        elif op == "release" and held:
            pool.release(held.pop(arg % len(held)))
        elif op == "hit":
            page = pool.lookup(h(arg))
            if page is not None:
                pool.acquire(page)
                held.append(page)
        refs = pool.refcounts()
        assert sum(refs) == len(held)
        assert pool.num_used == sum(1 for r in refs if r > 0)
        assert pool.num_free + pool.num_used == pool.num_pages
    for page in held:
        pool.release(page)
    assert pool.refcounts() == [0] * 4 and pool.num_free == 4
