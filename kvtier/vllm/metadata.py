"""What the scheduler-side connector tells the worker-side one for one engine step.

Built by :meth:`KvtierScheduler.build_connector_meta` in the scheduler process, shipped with the
step's ``SchedulerOutput`` to the worker process (pickled: plain data only), read there by
:class:`KvtierWorker` while the step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """A producer leg whose prompt is complete after this step: supply every full block (or,
    with ``kv_request_id`` None, a request under ``offload_prompts``: store them in host pages).

    ``block_hashes[i]`` is kvtier's hash of prompt block ``i``; ``block_ids[i]`` the vLLM KV
    block holding it (prefix-cache hits included: they are in the block table too)."""

    req_id: str
    kv_request_id: str | None
    num_tokens: int
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """A consumer leg waiting for remote KV: fetch these blocks, install them into ``block_ids``.

    ``first_block`` is the prompt block index of ``block_hashes[0]`` (the consumer's own prefix
    hit ends there); ``block_ids`` are the vLLM blocks allocated for the fetched range."""

    req_id: str
    kv_request_id: str
    remote_host: str
    remote_port: int
    remote_engine_id: str | None
    first_block: int
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReleaseSpec:
    """A consumer leg that needs nothing from its producer: tell it to drop the supply now."""

    kv_request_id: str
    remote_host: str
    remote_port: int
    remote_engine_id: str | None


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    releases: list[ReleaseSpec] = field(default_factory=list)
