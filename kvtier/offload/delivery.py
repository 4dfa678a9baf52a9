"""Deliveries to secondary tiers, collected during one manager call and made at its end.

Batching turns one completion of 512 keys into one ``submit_store`` per (tier, request) instead
of 512, and keeps tier callbacks out of the middle of the manager's bookkeeping. A failing tier
is logged and skipped; it never stops delivery to the others.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.keys import OffloadKey
from kvtier.offload.tier import SecondaryTier
from kvtier.offload.types import ReqContext, RequestId, StoreFailure, TierName

logger = logging.getLogger(__name__)


class Outbox:
    """What to tell which tier about which request, in delivery order: pending, stored, failed,
    finished."""

    __slots__ = ("_contexts", "_failures", "_finished", "_pending", "_stores", "pins")

    def __init__(self) -> None:
        self._stores: dict[tuple[TierName, RequestId], list[OffloadKey]] = {}
        self._pending: dict[tuple[TierName, RequestId], list[OffloadKey]] = {}
        self._failures: dict[tuple[TierName, RequestId, StoreFailure], list[OffloadKey]] = {}
        self._finished: list[ReqContext] = []
        self._contexts: dict[RequestId, ReqContext] = {}
        self.pins: list[OffloadKey] = []
        """Keys pinned in the pool until delivered (the caller unpins them after ``deliver``)."""

    def store(
        self, tiers: Sequence[SecondaryTier], ctx: ReqContext, keys: list[OffloadKey]
    ) -> None:
        rid = ctx.request_id
        self._contexts[rid] = ctx
        for tier in tiers:
            self._stores.setdefault((tier.name, rid), []).extend(keys)

    def pending(self, tiers: Sequence[SecondaryTier], ctx: ReqContext, key: OffloadKey) -> None:
        rid = ctx.request_id
        self._contexts[rid] = ctx
        for tier in tiers:
            self._pending.setdefault((tier.name, rid), []).append(key)

    def failure(
        self,
        tiers: Sequence[SecondaryTier],
        ctx: ReqContext,
        keys: list[OffloadKey],
        reason: StoreFailure,
    ) -> None:
        rid = ctx.request_id
        self._contexts[rid] = ctx
        for tier in tiers:
            self._failures.setdefault((tier.name, rid, reason), []).extend(keys)

    def finished(self, ctx: ReqContext) -> None:
        self._finished.append(ctx)

    def deliver(self, tiers: Sequence[SecondaryTier]) -> None:
        """Make every queued call, logging (not raising) a tier's failure."""
        by_name = {t.name: t for t in tiers}
        ctxs = self._contexts
        for (name, rid), keys in self._pending.items():
            try:
                by_name[name].on_store_pending(keys, ctxs[rid])
            except Exception:
                logger.exception("tier %s: on_store_pending failed for %s", name, rid)
        for (name, rid), keys in self._stores.items():
            try:
                by_name[name].submit_store(keys, ctxs[rid])
            except Exception:
                logger.exception("tier %s: submit_store failed for %s", name, rid)
        for (name, rid, reason), keys in self._failures.items():
            try:
                by_name[name].on_store_failed(keys, ctxs[rid], reason)
            except Exception:
                logger.exception("tier %s: on_store_failed failed for %s", name, rid)
        for ctx in self._finished:
            for tier in tiers:
                try:
                    tier.on_request_finished(ctx)
                except Exception:
                    logger.exception(
                        "tier %s: on_request_finished failed for %s", tier.name, ctx.request_id
                    )
