"""The reference worker as a HOLDER: answers P2P offers (symmetric pull, ``remote_kv_source``).

:class:`DeviceHoldings` finds the contiguous leading run of offered keys this node holds, in
its host pool (READABLE pages) or only on its device (prefix-cached blocks). Device-only blocks
are cascaded into fresh host pages first, as a REQUEST_LEVEL supply does for a producer leg: the
device page is pinned (a reference) while it is copied, so the engine cannot reuse it meanwhile.
Pages that are being written (a store in flight) end the run; so does a host pool with no page
to free. What :meth:`DeviceHoldings.pin_leading` returns is referenced for the caller
(:class:`kvtier.p2p.offer.OfferDesk`), which hands it to the supply registry.

A copy, once started, always ends before its host pages are given back (cancellation waits
for it): a page is never freed while the copy thread writes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import KvtierError, OffloadError
from kvtier.keys import OffloadKey, split_offload_key
from kvtier.offload.pool import HostPagePool
from kvtier.offload.types import LookupResult
from kvtier.p2p.offer import HeldPage
from kvtier.p2p.tier import P2PTier
from kvtier.pages import CopyDirection
from kvtier.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)

PageCopy = Callable[[int, CopyDirection, Sequence[int], Sequence[int]], Awaitable[None]]
"""``copy(group, direction, device pages, host pages)`` (the connector's copy executor)."""


@dataclass(slots=True)
class _Cascade:
    """A device-only block on its way to a host page (both pinned until the copy ends)."""

    key: OffloadKey
    group: int
    device_page: int
    copied: bool = False


class DeviceHoldings:
    """Holdings (:class:`kvtier.p2p.offer.Holdings`) of one reference worker."""

    def __init__(self, tier: P2PTier, pool: HostPagePool, kv: KVCache, copy: PageCopy) -> None:
        self._tier = tier
        self._pool = pool
        self._kv = kv
        self._copy = copy

    async def pin_leading(self, keys: Sequence[OffloadKey]) -> list[HeldPage]:
        run: list[HeldPage | _Cascade] = []
        try:
            for key in keys:
                item = self._hold(key)
                if item is None:
                    break
                run.append(item)
            cascades = [item for item in run if isinstance(item, _Cascade)]
            if cascades:
                await self._cascade(cascades)
            return self._settle(run)
        except BaseException:
            self._drop(run)
            raise

    def _hold(self, key: OffloadKey) -> HeldPage | _Cascade | None:
        """``key`` pinned in the host pool, or staged for a copy from the device; None: the
        run ends here."""
        pinned = self._tier.pin_readable(key)
        if pinned is not None:
            return HeldPage(key, *pinned)
        block_hash, group = split_offload_key(key)
        if group >= len(self._kv.pools) or self._pool.lookup(key) is not LookupResult.MISS:
            return None  # a group this node lacks, or a host write in flight
        device = self._kv.pools[group]
        page = device.lookup(block_hash)
        if page is None:
            return None
        try:
            self._pool.allocate(key)
        except OffloadError:  # no host page can be freed
            return None
        device.acquire(page)
        return _Cascade(key, group, page)

    async def _cascade(self, cascades: list[_Cascade]) -> None:
        """Copy every staged block to its host page, group by group; a failed group's blocks
        stay uncopied (the run ends at the first of them)."""
        for group in sorted({c.group for c in cascades}):
            batch = [c for c in cascades if c.group == group]
            hosts = [self._pool.page_index(c.key) for c in batch]
            copy = asyncio.ensure_future(
                self._copy(
                    group, CopyDirection.DEVICE_TO_HOST, [c.device_page for c in batch], hosts
                )
            )
            try:
                await asyncio.shield(copy)
            except asyncio.CancelledError:
                await asyncio.wait([copy])  # its host pages are given back only after it ends
                raise
            except KvtierError as exc:
                logger.warning("offer: device→host copy of group %d failed: %s", group, exc)
                continue
            for c in batch:
                c.copied = True

    def _settle(self, run: list[HeldPage | _Cascade]) -> list[HeldPage]:
        """End every staged write, unpin device pages, and return the run up to its first
        block that did not make it (what follows is released)."""
        held: list[HeldPage] = []
        cut = False
        for item in run:
            if isinstance(item, _Cascade):
                self._end(item, item.copied)
                pinned = None if cut or not item.copied else self._tier.pin_readable(item.key)
                if pinned is None:
                    cut = True
                    continue
                page = HeldPage(item.key, *pinned)
            else:
                page = item
            if cut:
                page.page.release()
            else:
                held.append(page)
        return held

    def _drop(self, run: list[HeldPage | _Cascade]) -> None:
        """Give back everything a failed or cancelled offer staged or pinned."""
        for item in run:
            if isinstance(item, _Cascade):
                with contextlib.suppress(KvtierError):  # settled already
                    self._end(item, False)
            else:
                item.page.release()

    def _end(self, item: _Cascade, success: bool) -> None:
        if item.device_page < 0:
            return  # ended already
        page, item.device_page = item.device_page, -1
        self._kv.pools[item.group].release(page)
        self._pool.complete_write(item.key, success)
