"""A test-only secondary tier that records everything it receives (no mocks)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.offload import (
    HostPagePool,
    LookupResult,
    OffloadPolicy,
    PageRef,
    PageState,
    ReqContext,
    RequestId,
    RequestOffloadingContext,
    SecondaryTier,
    StoreFailure,
    TierName,
    producer_leg_policy,
)


def key(i: int, group: int = 0) -> OffloadKey:
    """A distinct offload key per ``(i, group)``."""
    return offload_key(BlockHash(i.to_bytes(16, "big")), group)


@dataclass
class RequestRecord:
    stored: list[OffloadKey] = field(default_factory=list)
    pending: list[OffloadKey] = field(default_factory=list)
    failed: dict[OffloadKey, StoreFailure] = field(default_factory=dict)
    finished: bool = False
    events: list[str] = field(default_factory=list)
    """Call order: "store", "pending", "failed", "finished"."""


class RecordingTier(SecondaryTier):
    """Records per request what the manager delivered; optionally pins delivered pages."""

    def __init__(
        self,
        name: str,
        pool: HostPagePool,
        *,
        policy: Callable[[Mapping[str, object] | None], OffloadPolicy] = producer_leg_policy,
        hold_refs: bool = False,
        accepts: Callable[[OffloadKey], bool] = lambda k: True,
    ) -> None:
        self._name = TierName(name)
        self.pool = pool
        self._policy = policy
        self._hold = hold_refs
        self._accepts = accepts
        self.records: dict[RequestId, RequestRecord] = {}
        self.refs: list[PageRef] = []
        self.violations: list[str] = []

    @property
    def name(self) -> TierName:
        return self._name

    def rec(self, rid: str) -> RequestRecord:
        return self.records.setdefault(RequestId(rid), RequestRecord())

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        self.rec(ctx.request_id)
        return RequestOffloadingContext(self._policy(ctx.kv_transfer_params))

    def accepts_store(self, key: OffloadKey, ctx: ReqContext) -> bool:
        return self._accepts(key)

    def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        r = self.rec(ctx.request_id)
        if r.finished:
            self.violations.append(f"submit_store after finish for {ctx.request_id}")
        for k in keys:
            if self.pool.state(k) is not PageState.READABLE:
                self.violations.append(f"{k.hex()} delivered while not readable")
            if self._hold:
                self.refs.append(self.pool.acquire(k))
        r.stored.extend(keys)
        r.events.append("store")

    def on_store_pending(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        r = self.rec(ctx.request_id)
        r.pending.extend(keys)
        r.events.append("pending")

    def on_store_failed(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, reason: StoreFailure
    ) -> None:
        r = self.rec(ctx.request_id)
        if r.finished:
            self.violations.append(f"on_store_failed after finish for {ctx.request_id}")
        for k in keys:
            r.failed[k] = reason
        r.events.append("failed")

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def on_request_finished(self, ctx: ReqContext) -> None:
        r = self.rec(ctx.request_id)
        if r.finished:
            self.violations.append(f"finished twice: {ctx.request_id}")
        r.finished = True
        r.events.append("finished")

    def release_all(self) -> None:
        for ref in self.refs:
            ref.release()
        self.refs.clear()


def block_level(params: Mapping[str, object] | None) -> OffloadPolicy:
    return OffloadPolicy.BLOCK_LEVEL


PRODUCER: dict[str, object] = {"remote_decoder": {"kv_request_id": "kv-1"}}
