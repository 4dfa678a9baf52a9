"""kvtier.offload: the tiering manager (pure Python; never imports torch).

- ``types``: vocabulary (LookupResult, OffloadPolicy, ReqContext, PrepareStoreOutput, events).
- ``policy``: the producer-leg REQUEST_LEVEL policy table.
- ``buffer`` / ``pool``: the primary tier, a host page pool over an abstract byte buffer.
- ``tier``: the SecondaryTier interface (P2P and others plug in here).
- ``manager`` / ``tiering``: the OffloadingManager interface and the TieringManager.
- ``window`` / ``scan``: the one sliding-window rule, load scans and store planning.
"""

from kvtier.offload.buffer import BytearrayPageBuffer, PageBuffer
from kvtier.offload.manager import OffloadingManager
from kvtier.offload.policy import producer_kv_request_id, producer_leg_policy
from kvtier.offload.pool import (
    HostPagePool,
    PageAllocation,
    PageRef,
    PageState,
    PoolStats,
    WriteListener,
)
from kvtier.offload.scan import (
    SCAN_BEHAVIOUR,
    RequestChunks,
    ScanBehaviour,
    ScanResult,
    StorePlan,
    plan_store,
    scan_request,
)
from kvtier.offload.tier import SecondaryTier
from kvtier.offload.tiering import TieringManager
from kvtier.offload.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    LookupResult,
    Medium,
    OffloadEvent,
    OffloadPolicy,
    PageSpec,
    PrepareStoreOutput,
    ReqContext,
    RequestId,
    RequestOffloadingContext,
    StoreFailure,
    TieringStats,
    TierName,
)
from kvtier.offload.window import (
    AttentionKind,
    ChunkLayout,
    GroupSpec,
    first_reachable_chunk,
    is_store_reachable,
    load_scan_end,
    needed_chunks,
    window_start,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "SCAN_BEHAVIOUR",
    "AttentionKind",
    "BytearrayPageBuffer",
    "ChunkLayout",
    "GroupSpec",
    "HostPagePool",
    "LookupResult",
    "Medium",
    "OffloadEvent",
    "OffloadPolicy",
    "OffloadingManager",
    "PageAllocation",
    "PageBuffer",
    "PageRef",
    "PageSpec",
    "PageState",
    "PoolStats",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestChunks",
    "RequestId",
    "RequestOffloadingContext",
    "ScanBehaviour",
    "ScanResult",
    "SecondaryTier",
    "StoreFailure",
    "StorePlan",
    "TierName",
    "TieringManager",
    "TieringStats",
    "WriteListener",
    "first_reachable_chunk",
    "is_store_reachable",
    "load_scan_end",
    "needed_chunks",
    "plan_store",
    "producer_kv_request_id",
    "producer_leg_policy",
    "scan_request",
    "window_start",
]
