"""The P2P secondary tier: a producer's supply, fed by the tiering manager.

Plug it into the manager like any :class:`~kvtier.offload.tier.SecondaryTier`::

    tier = P2PTier(pool, server.registry, fingerprint)

- ``on_new_request``: ``REQUEST_LEVEL`` exactly for producer legs with a non-empty
  ``kv_request_id`` (``kv_transfer_params={"remote_decoder": {"kv_request_id": K}}``); the
  request's supply K is opened (demand for it now waits instead of failing). Everything else
  stays ``BLOCK_LEVEL`` and, since :meth:`P2PTier.accepts_store` declines write-through, this
  tier then receives nothing.
- ``submit_store``: each key (cascaded from the primary tier, or newly written) is acquired from
  the pool inside the call and registered as supply for K, so it cannot be evicted while a peer
  may fetch it. Its tag under the registry's page key is computed the first time the page is
  supplied after its write completed, and cached with the page (:mod:`kvtier.p2p.page_tags`):
  a warm producer sends pages without reading them for a MAC.
- ``on_store_pending``: keys whose write is in flight are parked (demand waits for them).
- ``on_store_failed``: those keys fail their demand at once, with the reason.
- ``on_request_finished``: K is finished; unmet demand fails at once and the lease starts.

:meth:`P2PTier.close` detaches the tier's pool write listener.

The supply is released by the server (``done``, ``release``, consumer disconnect), by lease
expiry, or by :meth:`P2PTier.release`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

from kvtier.errors import UnknownKey
from kvtier.keys import OffloadKey
from kvtier.offload.policy import producer_kv_request_id
from kvtier.offload.pool import HostPagePool
from kvtier.offload.tier import SecondaryTier
from kvtier.offload.types import (
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    StoreFailure,
    TierName,
)
from kvtier.p2p.frames import KvRequestId
from kvtier.p2p.layout import LayoutFingerprint
from kvtier.p2p.page_tags import PageTagCache
from kvtier.p2p.pool_pages import PoolSupplyPage
from kvtier.p2p.sealing import PageTag
from kvtier.p2p.supply import SupplyRegistry

logger = logging.getLogger(__name__)

P2P_TIER = TierName("p2p")


class P2PTier(SecondaryTier):
    """Registers every chunk of a producer leg as supply for its kv_request_id."""

    def __init__(
        self,
        pool: HostPagePool,
        registry: SupplyRegistry,
        fingerprint: LayoutFingerprint,
        *,
        name: TierName = P2P_TIER,
    ) -> None:
        self._pool = pool
        self._registry = registry
        self._fingerprint = fingerprint
        self._name = name
        self._tags = PageTagCache()
        # Registered now, before any manager that holds this tier registers its own listener:
        # a rewritten page's old tag is dropped before the key can cascade here again.
        pool.add_write_listener(self._tags.on_write_done)

    def close(self) -> None:
        """Detach from the pool's write listeners (the tier keeps no other resource)."""
        self._pool.remove_write_listener(self._tags.on_write_done)

    @property
    def cached_tags(self) -> int:
        """Pages whose tag is cached (at most one per pool page)."""
        return len(self._tags)

    @property
    def name(self) -> TierName:
        return self._name

    @property
    def registry(self) -> SupplyRegistry:
        return self._registry

    def kv_request_id(self, ctx: ReqContext) -> KvRequestId | None:
        """K of a producer leg this tier took at REQUEST_LEVEL, else None."""
        state = ctx.tier_state.get(self._name)
        return KvRequestId(state) if isinstance(state, str) else None

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        kv_request_id = producer_kv_request_id(ctx.kv_transfer_params)
        if kv_request_id is None:
            return RequestOffloadingContext(OffloadPolicy.BLOCK_LEVEL)
        rid = KvRequestId(kv_request_id)
        ctx.tier_state[self._name] = rid
        self._registry.open(rid)
        logger.debug("p2p supply %s opened for request %s", rid, ctx.request_id)
        return RequestOffloadingContext(OffloadPolicy.REQUEST_LEVEL)

    def accepts_store(self, key: OffloadKey, ctx: ReqContext) -> bool:
        return False  # no write-through: supply exists only for producer legs

    def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        rid = self.kv_request_id(ctx)
        if rid is None:
            return
        for key in keys:
            try:
                nbytes = self._fingerprint.page_nbytes(key)
                ref = self._pool.acquire(key)
            except (UnknownKey, ValueError) as exc:
                # The manager's contract says READABLE; if not, fail the demand rather than wait.
                logger.warning("p2p supply %s: key %s not supplied: %s", rid, key.hex(), exc)
                self._registry.fail(rid, key, "page not readable at submit")
                continue
            try:
                page = PoolSupplyPage(ref, nbytes)
            except ValueError as exc:
                ref.release()
                self._registry.fail(rid, key, str(exc))
                continue
            tag = self._tags.tag_of(
                key, ref.index, partial(self._registry.page_sealer.tag, page.view())
            )
            self._registry.supply(rid, key, page, tag)

    def pin_readable(self, key: OffloadKey) -> tuple[PoolSupplyPage, PageTag] | None:
        """A reference on ``key``'s READABLE pool page and its tag (cached per write), or None
        when the pool lacks it or its write is still in flight (an offer's holder side)."""
        try:
            nbytes = self._fingerprint.page_nbytes(key)
            ref = self._pool.acquire(key)
        except (UnknownKey, ValueError):
            return None
        try:
            page = PoolSupplyPage(ref, nbytes)
            tag = self._tags.tag_of(
                key, ref.index, partial(self._registry.page_sealer.tag, page.view())
            )
        except BaseException:
            ref.release()
            raise
        return page, tag

    def on_store_pending(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        rid = self.kv_request_id(ctx)
        if rid is not None:
            for key in keys:
                self._registry.park(rid, key)

    def on_store_failed(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, reason: StoreFailure
    ) -> None:
        rid = self.kv_request_id(ctx)
        if rid is not None:
            for key in keys:
                self._registry.fail(rid, key, reason.value)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.MISS  # consumers fetch explicitly (P2PClient.fetch)

    def on_request_finished(self, ctx: ReqContext) -> None:
        rid = self.kv_request_id(ctx)
        if rid is not None:
            self._registry.finish(rid)

    def release(self, kv_request_id: str, reason: str = "released by the worker") -> bool:
        """Drop K's supply now (e.g. the worker's HTTP release endpoint)."""
        return self._registry.release(KvRequestId(kv_request_id), reason)
