"""The engine-facing interface of a tiering manager.

The engine calls it from its scheduler. One request's life::

    on_new_request(ctx)                      tiers declare their policy (ctx.policies)
    lookup(key, ctx) per chunk               via ``scan.scan_request`` (load side)
    prepare_load(keys, ctx) → PageSpec       pins the host pages; engine copies host → GPU
    complete_load(keys, ctx)                 unpins them
    prepare_store(keys, ctx) → output        engine copies GPU → host for ``keys_to_store``
    complete_store(keys, ctx, success)       pages become readable (or are dropped)
    on_request_finished(ctx)                 tiers hear it once the request's writes drained
    take_events()                            stored/removed events for the residency publisher
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence

from kvtier.keys import OffloadKey
from kvtier.offload.types import (
    LookupResult,
    OffloadEvent,
    PageSpec,
    PrepareStoreOutput,
    ReqContext,
    StoreFailure,
)


class OffloadingManager(ABC):
    """Lookup, load and store of offload keys against the host tier (and whatever is behind it)."""

    @abstractmethod
    def on_new_request(self, ctx: ReqContext) -> None:
        """Register ``ctx``; fills ``ctx.policies`` from the tiers' declarations."""

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Where ``key`` stands for a load (see ``LookupResult`` and ``scan.SCAN_BEHAVIOUR``)."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PageSpec:
        """Pin the READABLE host pages of ``keys`` for a host→GPU copy; returns their indices.

        Raises ``UnknownKey`` (pinning nothing) if any key is not READABLE.
        """

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Unpin pages pinned by ``prepare_load`` for ``ctx`` (copy done or abandoned)."""

    @abstractmethod
    def prepare_store(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        *,
        cascade_only: Mapping[OffloadKey, StoreFailure] | None = None,
    ) -> PrepareStoreOutput:
        """Offer ``keys`` (whose GPU blocks the engine holds) for storing.

        Returns the keys that need a GPU→host copy. Keys already in the host tier are not copied;
        for REQUEST_LEVEL tiers they cascade (readable ones at once, in-flight ones when their
        write completes). ``cascade_only`` lists keys the engine cannot copy (with the reason):
        they cascade if the host tier holds them, else request-level tiers hear the reason as an
        explicit failure. ``scan.plan_store`` builds both arguments.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool) -> None:
        """The engine's GPU→host copy of ``keys`` (from ``prepare_store``) finished or failed."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark keys as recently used."""

    @abstractmethod
    def on_request_finished(self, ctx: ReqContext) -> None:
        """The engine is done with ``ctx``; its load pins are released, tiers are told once its
        pending writes drain."""

    @abstractmethod
    def take_events(self) -> list[OffloadEvent]:
        """Stored/removed events of every medium since the last call."""
