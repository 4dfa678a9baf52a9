"""Vocabulary of the tiering manager, close to vLLM's ``kv_offload`` (engine authors know it).

Pure Python: nothing here imports torch.

- :class:`LookupResult`: what a tier says about one offload key.
- :class:`OffloadPolicy`: whether a tier takes only newly stored chunks or every chunk of a request.
- :class:`ReqContext`: one request as the manager and its tiers see it.
- :class:`RequestOffloadingContext`: a tier's answer to ``on_new_request``.
- :class:`PrepareStoreOutput` / :class:`PageSpec`: what ``prepare_store`` / ``prepare_load`` hand
  to the engine's copy jobs.
- :class:`StoreFailure`: why a key a request offered will never reach a tier (explicit failure).
- :class:`OffloadEvent`: stored/removed per medium, for the residency publisher.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NewType

from kvtier.keys import OffloadKey

RequestId = NewType("RequestId", str)
"""The engine's id of a request (one leg)."""

TierName = NewType("TierName", str)
"""A secondary tier's unique name within one manager (e.g. ``"p2p"``)."""

Medium = NewType("Medium", str)
"""Where blocks live, as KV events name it (``"GPU"``, ``"CPU"``, or a tier's own medium)."""

MEDIUM_GPU = Medium("GPU")
MEDIUM_CPU = Medium("CPU")


class LookupResult(enum.Enum):
    """A tier's answer for one key. Every member has a declared scan behaviour (see ``scan``)."""

    MISS = "miss"
    """Not present and not coming: the scan treats it as a gap."""
    HIT = "hit"
    """Present and readable now."""
    HIT_PENDING = "hit_pending"
    """Present, its write in flight: counts as present (never as missing); a load waits for it."""
    RETRY = "retry"
    """Not decidable yet (a promotion or remote lookup is under way): ask again later."""


class OffloadPolicy(enum.Enum):
    """What a secondary tier receives for one request."""

    BLOCK_LEVEL = "block_level"
    """Only chunks this request newly wrote to the primary tier (write-through)."""
    REQUEST_LEVEL = "request_level"
    """Every chunk of the request: already-resident ones cascade without a GPU copy, in-flight ones
    when their write completes, new ones when this request's write completes."""


class StoreFailure(enum.Enum):
    """Why a key offered by a request will never reach a request-level tier."""

    WRITE_FAILED = "write_failed"
    """The GPU→host (or incoming) write of the page failed."""
    POOL_EXHAUSTED = "pool_exhausted"
    """The primary pool could not free a page; the store was refused."""
    NOT_STORABLE = "not_storable"
    """The engine has already freed the chunk's GPU blocks (sliding-window null blocks)."""
    OUT_OF_WINDOW = "out_of_window"
    """A sliding-window chunk that no load-path scan of this request can demand (pruned)."""
    EVICTED = "evicted"
    """The page was evicted (by another thread's allocation) before it could be delivered."""


@dataclass(frozen=True, slots=True)
class RequestOffloadingContext:
    """A tier's declaration for one request (its answer to ``on_new_request``)."""

    policy: OffloadPolicy = OffloadPolicy.BLOCK_LEVEL


@dataclass(slots=True, eq=False)
class ReqContext:
    """One request as the manager and its tiers see it.

    ``kv_transfer_params`` is the parsed JSON object of the request (``None`` when absent).
    ``tier_state`` is scratch space: each tier keeps its per-request state under its own name.
    ``policies`` is filled by ``TieringManager.on_new_request`` from the tiers' answers.
    Identity semantics (``eq=False``): two contexts are the same request only if they are the same
    object.
    """

    request_id: RequestId
    kv_transfer_params: Mapping[str, object] | None = None
    tier_state: dict[TierName, object] = field(default_factory=dict)
    policies: dict[TierName, OffloadPolicy] = field(default_factory=dict)

    @property
    def request_level_tiers(self) -> frozenset[TierName]:
        """Tiers that asked for every chunk of this request."""
        return frozenset(n for n, p in self.policies.items() if p is OffloadPolicy.REQUEST_LEVEL)

    @property
    def is_request_level(self) -> bool:
        """True when at least one tier asked for REQUEST_LEVEL: offer *every* chunk to store."""
        return any(p is OffloadPolicy.REQUEST_LEVEL for p in self.policies.values())


@dataclass(frozen=True, slots=True)
class PageSpec:
    """Primary host page indices, aligned with the keys they belong to."""

    page_indices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """Answer of ``prepare_store``.

    ``keys_to_store``: keys that need a GPU→host copy, in the order given; ``store_spec`` holds
    their destination host pages (same order). The engine copies, then calls
    ``complete_store(keys_to_store, ctx, success)``. ``evicted_keys``: keys evicted from the
    primary pool to make room. ``refused_keys``: keys the pool could not take (counted; they are
    reported to request-level tiers as ``POOL_EXHAUSTED``).
    """

    keys_to_store: tuple[OffloadKey, ...] = ()
    store_spec: PageSpec = PageSpec()
    evicted_keys: tuple[OffloadKey, ...] = ()
    refused_keys: tuple[OffloadKey, ...] = ()


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """Keys stored into or removed from one medium (the residency publisher turns these into
    ``BlockStored``/``BlockRemoved`` KV events; ``kvtier.keys.split_offload_key`` gives the block
    hash and group of each key)."""

    keys: tuple[OffloadKey, ...]
    medium: Medium
    removed: bool


@dataclass(frozen=True, slots=True)
class TieringStats:
    """Counters of a manager (keys, summed over tiers where several receive the same key)."""

    cascaded: int
    """Keys delivered to request-level tiers without a GPU copy (already readable)."""
    unparked: int
    """Keys delivered to request-level tiers when the write they were parked on completed."""
    write_through: int
    """Keys delivered to block-level tiers after this manager's write succeeded."""
    failed: int
    """Keys reported to request-level tiers as ``on_store_failed``."""
    refused: int
    """Keys the pool refused (PoolExhausted) in ``prepare_store``."""
    parked: int
    """Keys currently parked on an in-flight write (gauge)."""
    requests: int
    """Requests registered and not yet finished-and-drained (gauge)."""
