"""KV-cache groups and the sliding-window rule that bounds which blocks a step reads.

A group is a set of layers sharing one page pool and one attention shape: full attention, or a
sliding window of ``sliding_window`` tokens (the query included). Which blocks a prefix hit needs
is :func:`kvtier.offload.window.needed_chunks` — the one window rule that also prunes the store
path and bounds the consumer's demand — with one block per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kvtier.offload.window import AttentionKind, ChunkLayout, GroupSpec, needed_chunks


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One KV-cache group: its layers, its window (None = full attention) and its page shape."""

    index: int
    layers: tuple[int, ...]
    sliding_window: int | None
    page_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def page_numel(self) -> int:
        n = 1
        for d in self.page_shape:
            n *= d
        return n

    @property
    def page_nbytes(self) -> int:
        return self.page_numel * torch.empty((), dtype=self.dtype).element_size()


def first_attended_position(position: int, sliding_window: int | None) -> int:
    """Lowest token position that the token at ``position`` attends to."""
    if sliding_window is None:
        return 0
    return max(0, position - sliding_window + 1)


def needed_blocks(num_cached_blocks: int, sliding_window: int | None, block_size: int) -> range:
    """Blocks of ``[0, num_cached_blocks)`` that computing from block ``num_cached_blocks`` reads.

    Full attention reads every earlier block; a sliding window reads only the blocks that hold a
    position inside the window of the first token computed (later tokens attend further right).
    """
    group, layout = _window_layout(sliding_window, block_size)
    return needed_chunks(num_cached_blocks, group, layout)


@lru_cache(maxsize=64)
def _window_layout(sliding_window: int | None, block_size: int) -> tuple[GroupSpec, ChunkLayout]:
    if sliding_window is None:
        group = GroupSpec(0)
    else:
        group = GroupSpec(0, AttentionKind.SLIDING_WINDOW, sliding_window)
    return group, ChunkLayout(block_size, 1, (group,))
