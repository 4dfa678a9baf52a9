"""I1 supply ⊇ demand, as a property over request shapes (DESIGN §4).

A producer runs a REQUEST_LEVEL request through the real TieringManager in one of four cache
states (cold, GPU-warm, primary-warm, store in flight by another request), with or without a
sliding-window group, for any alignment and tail. A consumer then scans the same prompt with the
load path's scan, looking keys up in what the producer's request-level tier received. Every key
the scan demands must be supplied or explicitly failed; when the engine frees only what the
window rule allows and no write fails, the consumer loads the whole scan range.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.keys import BlockHasher, OffloadKey
from kvtier.offload import (
    AttentionKind,
    BytearrayPageBuffer,
    ChunkLayout,
    GroupSpec,
    HostPagePool,
    LookupResult,
    ReqContext,
    RequestChunks,
    RequestId,
    StoreFailure,
    TieringManager,
    first_reachable_chunk,
    load_scan_end,
    plan_store,
    scan_request,
)
from tests.kvtier.offload.recording_tier import PRODUCER, RecordingTier, block_level

STATES = ("cold", "gpu_warm", "primary_warm", "store_in_flight")


@st.composite
def shapes(draw: st.DrawFn) -> dict[str, object]:
    block_size = draw(st.sampled_from([2, 4]))
    blocks_per_chunk = draw(st.integers(1, 2))
    chunk_tokens = block_size * blocks_per_chunk
    with_swa = draw(st.booleans())
    groups: tuple[GroupSpec, ...] = (GroupSpec(0),)
    if with_swa:
        window = draw(st.integers(1, 4 * chunk_tokens))
        groups = (*groups, GroupSpec(1, AttentionKind.SLIDING_WINDOW, window))
    layout = ChunkLayout(block_size, blocks_per_chunk, groups, draw(st.integers(1, 3)))
    full = draw(st.integers(0, 12))
    num_tokens = full * chunk_tokens + draw(st.integers(0, chunk_tokens - 1))
    return {
        "layout": layout,
        "num_tokens": num_tokens,
        "state": draw(st.sampled_from(STATES)),
        "warm": draw(st.integers(0, full)),
        "in_flight_ok": draw(st.booleans()),
        "engine_frees": draw(st.sampled_from(["unreachable", "arbitrary"])),
        "arbitrary_freed": draw(st.frozensets(st.integers(0, max(0, full - 1)), max_size=full)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def run_producer(
    layout: ChunkLayout,
    req: RequestChunks,
    state: str,
    warm: int,
    in_flight_ok: bool,
) -> tuple[set[OffloadKey], dict[OffloadKey, StoreFailure], set[OffloadKey], set[OffloadKey]]:
    """Returns (supplied, failed, offered, copied) as seen by the request-level tier."""
    pool = HostPagePool(BytearrayPageBuffer(4 * 2 * 13, 4))
    p2p = RecordingTier("p2p", pool, accepts=lambda k: False)
    disk = RecordingTier("disk", pool, policy=block_level)
    manager = TieringManager(pool, [p2p, disk])
    warm_keys = [k for group_keys in req.keys for k in group_keys[:warm]]
    other = ReqContext(RequestId("other"))
    manager.on_new_request(other)
    other_out = None
    if state in ("primary_warm", "store_in_flight"):
        other_out = manager.prepare_store(warm_keys, other)
        if state == "primary_warm":
            manager.complete_store(other_out.keys_to_store, other, True)
    producer = ReqContext(RequestId("producer"), PRODUCER)
    manager.on_new_request(producer)
    assert producer.is_request_level
    plan = plan_store(req, layout, request_level=True)
    out = manager.prepare_store(plan.keys, producer, cascade_only=plan.cascade_only)
    copied = set(out.keys_to_store)
    if state in ("primary_warm", "store_in_flight"):
        assert not copied & set(warm_keys), "I2: a key present in the host tier was copied again"
    manager.on_request_finished(producer)  # before its writes drain: must wait for them
    manager.complete_store(out.keys_to_store, producer, True)
    if state == "store_in_flight":
        assert other_out is not None
        manager.complete_store(other_out.keys_to_store, other, in_flight_ok)
    rec = p2p.rec("producer")
    assert rec.finished and p2p.violations == []
    assert rec.events[-1] == "finished"
    offered = set(plan.keys) | set(plan.cascade_only)
    supplied = set(rec.stored)
    assert len(rec.stored) == len(supplied), "a key was delivered twice"
    assert not supplied & set(rec.failed)
    assert offered == supplied | set(rec.failed), "a key was neither supplied nor failed"
    assert disk.rec("producer").stored == [k for k in out.keys_to_store]  # write-through only
    manager.close()
    return supplied, rec.failed, offered, copied


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes())
def test_supply_covers_demand(shape: dict[str, object]) -> None:
    layout = shape["layout"]
    num_tokens = shape["num_tokens"]
    state = shape["state"]
    warm = shape["warm"]
    assert isinstance(layout, ChunkLayout) and isinstance(num_tokens, int)
    assert isinstance(state, str) and isinstance(warm, int)
    hasher = BlockHasher(f"model-{shape['seed']}", layout.block_size)
    hashes = hasher.hash_tokens([i % 50_000 for i in range(num_tokens)])
    n_chunks = layout.full_chunks(num_tokens)
    freed: list[frozenset[int]] = []
    for group in layout.groups:
        if group.kind is AttentionKind.FULL:
            freed.append(frozenset())
        elif shape["engine_frees"] == "unreachable":
            freed.append(frozenset(range(first_reachable_chunk(num_tokens, group, layout))))
        else:
            arbitrary = shape["arbitrary_freed"]
            assert isinstance(arbitrary, frozenset)
            freed.append(frozenset(i for i in arbitrary if i < n_chunks))
    req = RequestChunks.from_block_hashes(
        layout,
        hashes,
        num_tokens,
        freed=tuple(freed),
        new_from_chunk=warm if state == "gpu_warm" else 0,
    )
    supplied, failed, offered, _ = run_producer(
        layout, req, state, warm, bool(shape["in_flight_ok"])
    )

    # the consumer: same prompt, nothing local, every lookup answered by the producer's supply
    unanswered: list[OffloadKey] = []

    def remote(key: OffloadKey) -> LookupResult:
        if key in supplied:
            return LookupResult.HIT
        if key not in failed:
            unanswered.append(key)
        return LookupResult.MISS

    res = scan_request(req, remote, layout)
    assert unanswered == [], "demand for a key the producer neither supplied nor failed"
    assert set(res.consulted) <= offered
    for group_keys in res.load_keys:
        assert set(group_keys) <= supplied

    write_failed = state == "store_in_flight" and not shape["in_flight_ok"] and warm > 0
    if shape["engine_frees"] == "unreachable" and not write_failed:
        # the engine kept what the window rule says: the consumer loads the whole range
        assert res.hit_chunks == load_scan_end(num_tokens, layout)
        assert set(failed.values()) <= {StoreFailure.OUT_OF_WINDOW}
