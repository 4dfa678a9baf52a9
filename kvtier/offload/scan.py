"""Chunk scanning: the engine-facing side of lookup (load) and store planning.

:data:`SCAN_BEHAVIOUR` declares, for every :class:`LookupResult`, how it affects a scan. It is
checked at import: a member without a declared behaviour makes this module fail to import (and a
test enumerates the table), so a new member cannot silently widen demand.

:func:`scan_request` finds the longest aligned hit over every KV-cache group: a maximal prefix for
full-attention groups, the rightmost complete window for sliding-window groups, both bounded by
:func:`~kvtier.offload.window.load_scan_end` and :func:`~kvtier.offload.window.needed_chunks`.
:func:`plan_store` builds ``prepare_store``'s arguments with the same window rule, reporting
chunks it cannot copy (freed by the engine, or out of the window) explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.keys import BlockHash, OffloadKey, chunk_offload_keys
from kvtier.offload.types import LookupResult, StoreFailure
from kvtier.offload.window import (
    AttentionKind,
    ChunkLayout,
    GroupSpec,
    is_store_reachable,
    load_scan_end,
    needed_chunks,
)


@dataclass(frozen=True, slots=True)
class ScanBehaviour:
    """How one lookup answer affects a scan."""

    counts_as_present: bool
    """Extends the streak (prefix or window); ``False`` ends it (a gap)."""
    load_waits: bool
    """A load of this key must wait for its in-flight write to complete."""
    rescan: bool
    """The scan's answer is provisional: the engine scans again later."""


SCAN_BEHAVIOUR: Mapping[LookupResult, ScanBehaviour] = {
    LookupResult.HIT: ScanBehaviour(counts_as_present=True, load_waits=False, rescan=False),
    LookupResult.HIT_PENDING: ScanBehaviour(counts_as_present=True, load_waits=True, rescan=False),
    LookupResult.RETRY: ScanBehaviour(counts_as_present=True, load_waits=False, rescan=True),
    LookupResult.MISS: ScanBehaviour(counts_as_present=False, load_waits=False, rescan=False),
}

_undeclared = set(LookupResult) - set(SCAN_BEHAVIOUR)
if _undeclared:  # pragma: no cover - guarded by tests/kvtier/offload/test_scan.py
    raise TypeError(
        f"LookupResult members without a scan behaviour: {sorted(map(str, _undeclared))}"
    )


@dataclass(frozen=True, slots=True)
class RequestChunks:
    """A request's chunks as the engine knows them.

    ``keys[g]``: the key of every full chunk of layout group ``g`` (same order as
    ``layout.groups``). ``freed[g]``: chunk indices of group ``g`` whose GPU blocks the engine has
    already freed (sliding-window null blocks). ``new_from_chunk``: the first chunk this request
    computed itself (earlier ones were GPU prefix-cache hits).
    """

    num_tokens: int
    keys: tuple[tuple[OffloadKey, ...], ...]
    freed: tuple[frozenset[int], ...] = ()
    new_from_chunk: int = 0

    @classmethod
    def from_block_hashes(
        cls,
        layout: ChunkLayout,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        *,
        freed: tuple[frozenset[int], ...] = (),
        new_from_chunk: int = 0,
    ) -> RequestChunks:
        hashes = [BlockHash(h) for h in block_hashes]
        keys = tuple(
            tuple(chunk_offload_keys(hashes, layout.blocks_per_chunk, g.group))
            for g in layout.groups
        )
        return cls(num_tokens, keys, freed, new_from_chunk)

    def freed_in(self, group_pos: int) -> frozenset[int]:
        return self.freed[group_pos] if group_pos < len(self.freed) else frozenset()


@dataclass(frozen=True, slots=True)
class ScanResult:
    """Outcome of :func:`scan_request`.

    ``hit_chunks``: aligned chunks loadable for every group. ``load_keys[g]``: keys of layout group
    ``g`` to load for that hit. ``ready``: no key inside the hit answered ``RETRY`` (else scan
    again later). ``wait_keys``: ``HIT_PENDING`` keys inside the hit (load after their write).
    ``consulted``: every key whose lookup was asked, in order — the scan's demand.
    """

    hit_chunks: int
    load_keys: tuple[tuple[OffloadKey, ...], ...]
    ready: bool
    wait_keys: tuple[OffloadKey, ...]
    consulted: tuple[OffloadKey, ...] = field(default=())


class _Memo:
    """Each key is looked up at most once per scan (lookups may start promotions)."""

    __slots__ = ("answers", "lookup")

    def __init__(self, lookup: Callable[[OffloadKey], LookupResult]) -> None:
        self.lookup = lookup
        self.answers: dict[OffloadKey, LookupResult] = {}

    def present(self, key: OffloadKey) -> bool:
        answer = self.answers.get(key)
        if answer is None:
            answer = self.lookup(key)
            self.answers[key] = answer
        return SCAN_BEHAVIOUR[answer].counts_as_present


def _group_hit_end(
    keys: tuple[OffloadKey, ...], group: GroupSpec, end: int, layout: ChunkLayout, memo: _Memo
) -> int:
    """Largest aligned ``e <= end`` whose needed chunks of ``group`` are all present."""
    e = layout.align_down(min(end, len(keys)))
    if group.kind is AttentionKind.FULL:
        # Maximal prefix, left to right: nothing past the first gap is demanded.
        gap = next((i for i in range(e) if not memo.present(keys[i])), None)
        return e if gap is None else layout.align_down(gap)
    # Sliding window, right to left: after a gap at i, the next candidate end is i.
    while e > 0:
        window = reversed(needed_chunks(e, group, layout))
        gap = next((i for i in window if not memo.present(keys[i])), None)
        if gap is None:
            return e
        e = layout.align_down(gap)
    return 0


def scan_request(
    request: RequestChunks,
    lookup: Callable[[OffloadKey], LookupResult],
    layout: ChunkLayout,
) -> ScanResult:
    """Longest aligned hit over every group of ``layout``, bounded by the one window rule."""
    if len(request.keys) != len(layout.groups):
        raise ValueError(
            f"request has keys for {len(request.keys)} groups, layout has {len(layout.groups)}"
        )
    memo = _Memo(lookup)
    end = load_scan_end(request.num_tokens, layout)
    while True:
        new_end = end
        for keys, group in zip(request.keys, layout.groups, strict=True):
            new_end = min(new_end, _group_hit_end(keys, group, new_end, layout, memo))
        if new_end == end:
            break
        end = new_end
    load_keys = tuple(
        tuple(keys[i] for i in needed_chunks(end, group, layout))
        for keys, group in zip(request.keys, layout.groups, strict=True)
    )
    inside = [memo.answers[k] for keys in load_keys for k in keys]
    return ScanResult(
        hit_chunks=end,
        load_keys=load_keys,
        ready=not any(SCAN_BEHAVIOUR[a].rescan for a in inside),
        wait_keys=tuple(
            k for keys in load_keys for k in keys if SCAN_BEHAVIOUR[memo.answers[k]].load_waits
        ),
        consulted=tuple(memo.answers),
    )


@dataclass(frozen=True, slots=True)
class StorePlan:
    """Arguments of ``prepare_store``: keys whose GPU blocks can be copied, and keys that cannot
    be (cascade if the host tier holds them, else an explicit failure with the reason)."""

    keys: tuple[OffloadKey, ...]
    cascade_only: Mapping[OffloadKey, StoreFailure]


def plan_store(request: RequestChunks, layout: ChunkLayout, *, request_level: bool) -> StorePlan:
    """What a request offers to store.

    REQUEST_LEVEL: every chunk of every group — copyable ones in ``keys``, freed and out-of-window
    ones in ``cascade_only`` (never silently dropped). BLOCK_LEVEL: only chunks this request
    computed (from ``new_from_chunk``) that are reachable and not freed.
    """
    keys: list[OffloadKey] = []
    cascade_only: dict[OffloadKey, StoreFailure] = {}
    for pos, (group_keys, group) in enumerate(zip(request.keys, layout.groups, strict=True)):
        freed = request.freed_in(pos)
        for i, key in enumerate(group_keys):
            reachable = is_store_reachable(i, request.num_tokens, group, layout)
            if i in freed or not reachable:
                if request_level:
                    reason = StoreFailure.NOT_STORABLE if reachable else StoreFailure.OUT_OF_WINDOW
                    cascade_only[key] = reason
            elif request_level or i >= request.new_from_chunk:
                keys.append(key)
    return StorePlan(tuple(keys), cascade_only)
