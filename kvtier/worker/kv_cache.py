"""The engine's KV cache: one page pool per group, prefix hits across groups, reservations.

A request is admitted only when every group can reserve the pages its whole life needs (prompt
plus ``max_tokens``), so a running request never runs out of pages and nothing is preempted.
Prefix hits follow the window rule of :mod:`kvtier.worker.kv_layout`: a full-attention group
needs every earlier block, a sliding-window group only the blocks inside the window.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from kvtier.errors import PoolExhausted
from kvtier.keys import BlockHash
from kvtier.worker.backends.base import NO_PAGE
from kvtier.worker.kv_layout import KVGroupSpec, needed_blocks
from kvtier.worker.page_pool import CacheListener, PagePool
from kvtier.worker.request import EngineRequest

BlockStoredListener = Callable[[int, BlockHash, BlockHash | None, Sequence[int]], None]
"""Called with (group, block hash, parent hash or None, the block's token ids) when a block
enters a group's prefix cache."""

logger = logging.getLogger(__name__)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCache:
    """Page pools of every group plus the accounting that admission relies on."""

    def __init__(
        self,
        groups: Sequence[KVGroupSpec],
        block_size: int,
        num_pages: int,
        device: torch.device,
        *,
        on_stored: BlockStoredListener | None = None,
        on_removed: CacheListener | None = None,
    ) -> None:
        self.block_size = block_size
        self.pools = [PagePool(g, num_pages, device, on_removed=on_removed) for g in groups]
        self._on_stored = on_stored
        self._outstanding = [0] * len(self.pools)

    # -- prefix hits ---------------------------------------------------------------------------
    def hit_blocks(
        self,
        hashes: Sequence[BlockHash],
        cap: int,
        has: Callable[[int, int], bool] | None = None,
    ) -> int:
        """Largest ``n ≤ cap`` such that every group holds the blocks computing from ``n`` reads.

        ``has(group, block)`` defaults to "the group's pool caches that block's hash".
        """
        if has is None:

            def has(group: int, block: int) -> bool:
                return self.pools[group].lookup(hashes[block]) is not None

        n = min(cap, len(hashes))
        while n > 0:
            missing = -1
            for pool in self.pools:
                for b in needed_blocks(n, pool.spec.sliding_window, self.block_size):
                    if not has(pool.spec.index, b):
                        missing = b
                        break
                if missing != -1:
                    break
            if missing == -1:
                return n
            # Every candidate in (missing, n] reads the missing block (windows only slide
            # left as n shrinks), so the next candidate is ``missing`` itself.
            n = missing
        return 0

    @staticmethod
    def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
        """Hits stop one token short of the prompt: the last token is always computed."""
        return max(0, (num_prompt_tokens - 1) // block_size)

    # -- admission -----------------------------------------------------------------------------
    def try_admit(self, req: EngineRequest) -> bool:
        """Acquire the prefix hit and reserve the rest; False (nothing held) when it won't fit."""
        bs = self.block_size
        hashes = req.hashes.hashes
        n = self.hit_blocks(hashes, self.max_hit_blocks(len(req.prompt_ids), bs))
        total_blocks = _ceil_div(len(req.prompt_ids) + req.params.max_tokens, bs)
        tables: list[list[int]] = []
        for pool in self.pools:
            needed = set(needed_blocks(n, pool.spec.sliding_window, bs))
            table = [NO_PAGE] * n
            for b in needed:
                page = pool.lookup(hashes[b])
                assert page is not None  # hit_blocks checked it
                pool.acquire(page)
                table[b] = page
            tables.append(table)
        reserve = total_blocks - n
        fits = all(
            reserve <= pool.num_free - self._outstanding[i] for i, pool in enumerate(self.pools)
        )
        if not fits:
            for pool, table in zip(self.pools, tables, strict=True):
                for page in table:
                    if page != NO_PAGE:
                        pool.release(page)
            return False
        for i in range(len(self.pools)):
            self._outstanding[i] += reserve
        req.page_tables = tables
        req.reserved = [reserve] * len(self.pools)
        req.num_computed = n * bs
        req.num_cached_tokens = n * bs
        self.release_pinned(req)
        return True

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` (prompt + max_tokens) fits in an empty cache."""
        return _ceil_div(num_tokens, self.block_size) <= min(p.num_pages for p in self.pools)

    def ensure_pages(self, req: EngineRequest, upto_tokens: int) -> None:
        """Allocate (from the request's reservation) the pages for tokens ``[0, upto_tokens)``."""
        blocks = _ceil_div(upto_tokens, self.block_size)
        for i, pool in enumerate(self.pools):
            table = req.page_tables[i]
            while len(table) < blocks:
                if req.reserved[i] <= 0:
                    raise PoolExhausted(f"request {req.request_id} outgrew its reservation")
                table.append(pool.allocate())
                req.reserved[i] -= 1
                self._outstanding[i] -= 1

    def register_full_blocks(self, req: EngineRequest, first_block: int) -> None:
        """Cache the request's blocks ``[first_block, computed full blocks)`` in every group."""
        bs = self.block_size
        hashes = req.hashes.hashes
        n_full = min(req.num_computed // bs, len(hashes))
        if first_block >= n_full:
            return
        tokens = req.all_ids
        for b in range(first_block, n_full):
            for i in range(len(self.pools)):
                page = req.page_tables[i][b]
                if page != NO_PAGE:
                    parent = hashes[b - 1] if b > 0 else None
                    self.register(i, page, hashes[b], parent, tokens[b * bs : (b + 1) * bs])

    def register(
        self,
        group: int,
        page: int,
        block_hash: BlockHash,
        parent: BlockHash | None,
        token_ids: Sequence[int],
    ) -> bool:
        """Cache ``page`` under ``block_hash`` in ``group`` (False: already cached elsewhere)."""
        if not self.pools[group].register(page, block_hash):
            return False
        if self._on_stored is not None:
            self._on_stored(group, block_hash, parent, token_ids)
        return True

    def free(self, req: EngineRequest) -> None:
        """Release every page and the unused reservation of a request (idempotent)."""
        for i, pool in enumerate(self.pools):
            for page in req.page_tables[i]:
                if page != NO_PAGE:
                    pool.release(page)
            req.page_tables[i] = []
            self._outstanding[i] -= req.reserved[i]
            req.reserved[i] = 0
        self.release_pinned(req)

    # -- pages outside reservations (installing remote blocks) ---------------------------------
    def allocate_spare(self, group: int) -> int | None:
        """A page for an installed remote block, only if admission reservations stay whole."""
        pool = self.pools[group]
        if pool.num_free - self._outstanding[group] <= 0:
            return None
        return pool.allocate()

    def release_pinned(self, req: EngineRequest) -> None:
        for group, page in req.pinned:
            self.pools[group].release(page)
        req.pinned = []
