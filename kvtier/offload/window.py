"""The one window rule (invariant I3): chunk layout and sliding-window arithmetic.

The store path prunes sliding-window chunks with :func:`is_store_reachable`; the load path's scan
starts at :func:`load_scan_end` and checks the chunks of :func:`needed_chunks`. Both come from
:func:`window_start`, so what a load scan of a request can demand first is exactly what the store
path of the same request keeps. An engine must keep a sliding-window group's GPU blocks for every
chunk from :func:`first_reachable_chunk` on until they are stored.

Positions: chunk ``i`` covers tokens ``[i * chunk_tokens, (i + 1) * chunk_tokens)``. A hit of
``e`` chunks resumes computation at token ``e * chunk_tokens``; a sliding-window layer with a
window of ``w`` tokens (the query itself included) then needs the ``w - 1`` tokens before it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.keys import MAX_GROUPS


class AttentionKind(enum.Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV-cache group: its index (the offload key's group) and attention kind."""

    group: int
    kind: AttentionKind = AttentionKind.FULL
    window_tokens: int = 0
    """Sliding window in tokens, the query included (sliding-window groups only)."""

    def __post_init__(self) -> None:
        if not 0 <= self.group < MAX_GROUPS:
            raise ValueError(f"group index out of range: {self.group}")
        if self.kind is AttentionKind.SLIDING_WINDOW and self.window_tokens <= 0:
            raise ValueError("a sliding-window group needs window_tokens > 0")


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How a request's tokens map to offload chunks, for every KV-cache group.

    ``alignment_chunks``: a load hit is a multiple of this many chunks (hybrid models whose groups
    need a common boundary).
    """

    block_size: int
    blocks_per_chunk: int
    groups: tuple[GroupSpec, ...]
    alignment_chunks: int = 1

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.blocks_per_chunk <= 0 or self.alignment_chunks <= 0:
            raise ValueError("block_size, blocks_per_chunk and alignment_chunks must be positive")
        if not self.groups:
            raise ValueError("a layout needs at least one KV-cache group")
        if len({g.group for g in self.groups}) != len(self.groups):
            raise ValueError("KV-cache group indices must be distinct")

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    def full_chunks(self, num_tokens: int) -> int:
        """Chunks fully covered by ``num_tokens`` (the ones that have keys)."""
        return max(0, num_tokens) // self.chunk_tokens

    def align_down(self, chunks: int) -> int:
        return chunks - chunks % self.alignment_chunks


def load_scan_end(num_tokens: int, layout: ChunkLayout) -> int:
    """The most chunks a load of a ``num_tokens`` prompt may cover: at least one token is left
    to compute, and the hit is aligned."""
    if num_tokens <= 0:
        return 0
    return layout.align_down((num_tokens - 1) // layout.chunk_tokens)


def window_start(end_chunk: int, group: GroupSpec, layout: ChunkLayout) -> int:
    """First chunk a hit of ``end_chunk`` chunks needs in ``group`` (0 for full attention)."""
    if group.kind is AttentionKind.FULL or end_chunk <= 0:
        return 0
    first_token = max(0, end_chunk * layout.chunk_tokens - (group.window_tokens - 1))
    return first_token // layout.chunk_tokens


def needed_chunks(end_chunk: int, group: GroupSpec, layout: ChunkLayout) -> range:
    """Chunks of ``group`` a hit of ``end_chunk`` chunks must load."""
    return range(window_start(end_chunk, group, layout), max(0, end_chunk))


def first_reachable_chunk(num_tokens: int, group: GroupSpec, layout: ChunkLayout) -> int:
    """First chunk of ``group`` that a load scan of a ``num_tokens`` prompt demands first; the
    store path keeps every chunk from here on."""
    return window_start(load_scan_end(num_tokens, layout), group, layout)


def is_store_reachable(
    chunk_index: int, num_tokens: int, group: GroupSpec, layout: ChunkLayout
) -> bool:
    """Whether the store path keeps chunk ``chunk_index`` of ``group`` (same rule as the scan)."""
    return chunk_index >= first_reachable_chunk(num_tokens, group, layout)
