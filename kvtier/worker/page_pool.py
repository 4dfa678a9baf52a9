"""One KV-cache group's page pool on the device, with prefix caching.

Pages hold ``block_size`` tokens of KV for the group's layers. A page that holds a full block
may be *cached*: mapped from the block's hash, so a later request with the same prefix reuses it.
Pages carry reference counts; a page whose count drops to zero stays cached and joins an LRU of
free cached pages, evicted (least recently freed first) only when no uncached free page is left.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch

from kvtier.errors import PoolExhausted
from kvtier.keys import BlockHash
from kvtier.worker.kv_layout import KVGroupSpec

logger = logging.getLogger(__name__)

PageId = int
CacheListener = Callable[[int, list[BlockHash]], None]
"""Called with (group index, hashes) when blocks leave the prefix cache."""


class PagePool:
    """Pages of one KV-cache group: tensor storage, refcounts, prefix-cache map, LRU."""

    def __init__(
        self,
        spec: KVGroupSpec,
        num_pages: int,
        device: torch.device,
        *,
        on_removed: CacheListener | None = None,
    ) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.spec = spec
        self.num_pages = num_pages
        self.storage = torch.zeros((num_pages, *spec.page_shape), dtype=spec.dtype, device=device)
        self._bytes = self.storage.view(num_pages, -1).view(torch.uint8)
        self._refs = [0] * num_pages
        self._free_uncached: list[PageId] = list(range(num_pages - 1, -1, -1))
        self._free_cached: OrderedDict[PageId, None] = OrderedDict()
        self._by_hash: dict[BlockHash, PageId] = {}
        self._hash_of: dict[PageId, BlockHash] = {}
        self._on_removed = on_removed
        self.evictions = 0

    # -- queries -------------------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> PageId | None:
        return self._by_hash.get(block_hash)

    def refcount(self, page: PageId) -> int:
        return self._refs[page]

    def hash_of(self, page: PageId) -> BlockHash | None:
        return self._hash_of.get(page)

    @property
    def num_free(self) -> int:
        """Pages that an allocation can obtain (uncached free plus evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_pages

    def refcounts(self) -> list[int]:
        return list(self._refs)

    # -- reference counting --------------------------------------------------------------------
    def acquire(self, page: PageId) -> None:
        """Take a reference on a cached page (a prefix hit)."""
        if self._refs[page] == 0:
            self._free_cached.pop(page, None)
        self._refs[page] += 1

    def allocate(self) -> PageId:
        """A fresh page with one reference; evicts the least recently freed cached page."""
        if self._free_uncached:
            page = self._free_uncached.pop()
        elif self._free_cached:
            page, _ = self._free_cached.popitem(last=False)
            self._uncache(page)
            self.evictions += 1
        else:
            raise PoolExhausted(f"group {self.spec.index}: all {self.num_pages} pages in use")
        self._refs[page] = 1
        return page

    def release(self, page: PageId) -> None:
        """Drop a reference; at zero a cached page joins the LRU, an uncached one the free list."""
        if self._refs[page] <= 0:
            raise ValueError(f"group {self.spec.index}: page {page} released more than acquired")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._free_cached[page] = None
            else:
                self._free_uncached.append(page)

    def register(self, page: PageId, block_hash: BlockHash) -> bool:
        """Map ``block_hash`` to ``page`` (KV complete); False when already cached elsewhere."""
        if block_hash in self._by_hash or page in self._hash_of:
            return False
        self._by_hash[block_hash] = page
        self._hash_of[page] = block_hash
        return True

    def _uncache(self, page: PageId) -> None:
        block_hash = self._hash_of.pop(page)
        del self._by_hash[block_hash]
        if self._on_removed is not None:
            self._on_removed(self.spec.index, [block_hash])

    def clear_cache(self) -> int:
        """Forget every free cached page (a reset); returns how many were dropped."""
        dropped = 0
        while self._free_cached:
            page, _ = self._free_cached.popitem(last=False)
            self._uncache(page)
            self._free_uncached.append(page)
            dropped += 1
        return dropped

    # -- page bytes ----------------------------------------------------------------------------
    def page_bytes(self, page: PageId) -> torch.Tensor:
        """The page as a flat uint8 view (no copy) of ``spec.page_nbytes`` bytes."""
        return self._bytes[page]

    def write_page_bytes(self, page: PageId, data: bytes | bytearray | memoryview) -> None:
        """Overwrite a page from raw bytes (an installed remote block)."""
        view = memoryview(data).cast("B")
        if view.nbytes != self.spec.page_nbytes:
            raise ValueError(
                f"group {self.spec.index}: page is {self.spec.page_nbytes} bytes, got {view.nbytes}"
            )
        src = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        self._bytes[page].copy_(src)
