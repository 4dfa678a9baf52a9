"""Chunk scans, the scan-behaviour table and the one window rule (invariant I3)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import OffloadKey
from kvtier.offload import (
    SCAN_BEHAVIOUR,
    AttentionKind,
    ChunkLayout,
    GroupSpec,
    LookupResult,
    RequestChunks,
    StoreFailure,
    is_store_reachable,
    load_scan_end,
    needed_chunks,
    plan_store,
    scan_request,
    window_start,
)
from kvtier.offload import scan as scan_module
from kvtier.offload import window as window_module
from tests.kvtier.offload.recording_tier import key

FULL = GroupSpec(0)


def swa(window: int) -> GroupSpec:
    return GroupSpec(1, AttentionKind.SLIDING_WINDOW, window)


def chunks(layout: ChunkLayout, num_tokens: int) -> RequestChunks:
    n = layout.full_chunks(num_tokens)
    keys = tuple(tuple(key(i, g.group) for i in range(n)) for g in layout.groups)
    return RequestChunks(num_tokens, keys)


def test_every_lookup_result_has_a_declared_scan_behaviour() -> None:
    """Adding a LookupResult member without declaring its scan behaviour fails here."""
    for result in LookupResult:
        assert result in SCAN_BEHAVIOUR, f"{result} has no declared scan behaviour"
    assert set(SCAN_BEHAVIOUR) == set(LookupResult)
    # HIT_PENDING counts as present, never as missing (DESIGN §4)
    assert SCAN_BEHAVIOUR[LookupResult.HIT_PENDING].counts_as_present
    assert not SCAN_BEHAVIOUR[LookupResult.MISS].counts_as_present


@pytest.mark.parametrize("result", list(LookupResult))
@pytest.mark.parametrize("group", [FULL, swa(24)], ids=["full", "swa"])
def test_scan_follows_the_declared_behaviour(result: LookupResult, group: GroupSpec) -> None:
    """One chunk answers ``result``, the rest HIT: the scan does what the table declares."""
    layout = ChunkLayout(block_size=4, blocks_per_chunk=2, groups=(group,))
    req = chunks(layout, 8 * 10 + 3)  # 10 full chunks and a tail; scan end 10
    odd = req.keys[0][8]
    res = scan_request(req, lambda k: result if k == odd else LookupResult.HIT, layout)
    behaviour = SCAN_BEHAVIOUR[result]
    assert res.hit_chunks == (10 if behaviour.counts_as_present else 8)
    assert res.ready == (not behaviour.rescan or odd not in res.load_keys[0])
    assert (odd in res.wait_keys) == (behaviour.load_waits and odd in res.load_keys[0])
    assert odd in res.consulted


def test_prefix_scan_stops_at_the_first_gap_and_aligns() -> None:
    layout = ChunkLayout(block_size=4, blocks_per_chunk=1, groups=(FULL,), alignment_chunks=2)
    req = chunks(layout, 4 * 9)  # 9 chunks; scan end (36-1)//4 = 8
    gap = req.keys[0][5]
    asked: list[OffloadKey] = []

    def lookup(k: OffloadKey) -> LookupResult:
        asked.append(k)
        return LookupResult.MISS if k == gap else LookupResult.HIT

    res = scan_request(req, lookup, layout)
    assert res.hit_chunks == 4  # 5 aligned down to 2
    assert asked == list(req.keys[0][:6])  # nothing past the first gap is demanded
    assert res.load_keys == (req.keys[0][:4],)


def test_sliding_window_scan_moves_left_past_a_gap() -> None:
    layout = ChunkLayout(block_size=4, blocks_per_chunk=1, groups=(FULL, swa(10)))
    req = chunks(layout, 4 * 12 + 1)  # scan end 12; window of 10 tokens needs chunks 9..11
    assert list(needed_chunks(12, layout.groups[1], layout)) == [9, 10, 11]
    gap = req.keys[1][10]
    res = scan_request(req, lambda k: LookupResult.MISS if k == gap else LookupResult.HIT, layout)
    assert res.hit_chunks == 10
    assert res.load_keys[1] == req.keys[1][7:10]
    assert res.load_keys[0] == req.keys[0][:10]


def test_empty_and_short_requests() -> None:
    layout = ChunkLayout(block_size=4, blocks_per_chunk=1, groups=(FULL, swa(5)))
    for n in (0, 1, 4):
        res = scan_request(chunks(layout, n), lambda k: LookupResult.HIT, layout)
        assert res.hit_chunks == 0 and res.consulted == () and res.ready
    with pytest.raises(ValueError):
        scan_request(RequestChunks(4, ((),)), lambda k: LookupResult.HIT, layout)


layouts = st.builds(
    lambda bs, bpc, align, window, tail_groups: ChunkLayout(
        bs, bpc, (FULL, swa(window)) if tail_groups else (swa(window),), align
    ),
    st.sampled_from([1, 4, 16]),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 80),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(layouts, st.integers(0, 400))
def test_store_pruning_and_scan_bound_are_one_rule(layout: ChunkLayout, num_tokens: int) -> None:
    """I3: the chunks the load scan demands first are exactly the reachable chunks it can load."""
    req = chunks(layout, num_tokens)
    res = scan_request(req, lambda k: LookupResult.HIT, layout)
    end = load_scan_end(num_tokens, layout)
    assert res.hit_chunks == end
    for pos, group in enumerate(layout.groups):
        demanded = {i for i, k in enumerate(req.keys[pos]) if k in res.consulted}
        reachable = {i for i in range(end) if is_store_reachable(i, num_tokens, group, layout)}
        assert demanded == reachable
        assert demanded == set(needed_chunks(end, group, layout))
        assert min(demanded, default=window_start(end, group, layout)) == window_start(
            end, group, layout
        )


def test_store_path_and_scan_import_the_same_window_function() -> None:
    """The store path's pruning and the scan's bound are one function object, not two copies."""
    for name in ("is_store_reachable", "needed_chunks", "load_scan_end"):
        assert getattr(scan_module, name) is getattr(window_module, name)


def test_plan_store_reports_freed_and_pruned_chunks_explicitly() -> None:
    layout = ChunkLayout(block_size=4, blocks_per_chunk=1, groups=(FULL, swa(10)))
    n = 4 * 12 + 1  # scan end 12, SWA reach starts at chunk 9
    base = chunks(layout, n)
    req = RequestChunks(n, base.keys, freed=(frozenset(), frozenset({2, 10})), new_from_chunk=6)
    plan = plan_store(req, layout, request_level=True)
    swa_keys = base.keys[1]
    assert set(plan.keys) == set(base.keys[0]) | {swa_keys[9], swa_keys[11]}
    assert plan.cascade_only[swa_keys[10]] is StoreFailure.NOT_STORABLE
    assert plan.cascade_only[swa_keys[2]] is StoreFailure.OUT_OF_WINDOW
    assert set(plan.keys) | set(plan.cascade_only) == set(base.keys[0]) | set(swa_keys)
    block = plan_store(req, layout, request_level=False)
    assert set(block.keys) == set(base.keys[0][6:]) | {swa_keys[9], swa_keys[11]}
    assert block.cascade_only == {}


def test_group_spec_validation() -> None:
    with pytest.raises(ValueError):
        GroupSpec(1, AttentionKind.SLIDING_WINDOW)
    with pytest.raises(ValueError):
        ChunkLayout(4, 1, (FULL, FULL))
    with pytest.raises(ValueError):
        ChunkLayout(4, 0, (FULL,))
