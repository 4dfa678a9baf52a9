"""KV cache event types, field for field as vLLM publishes them.

An engine publishes :class:`EventBatch` es; each holds :class:`BlockStored`,
:class:`BlockRemoved` and :class:`AllBlocksCleared` events. Field names and their order are
vLLM's (``vllm/distributed/kv_events.py``); the wire encoding lives in :mod:`kvtier.events.codec`.

Engine block hashes are opaque: vLLM sends 64-bit integers (or bytes, for its sha256 hashes),
kvtier's own worker sends 16-byte :class:`kvtier.keys.BlockHash` es. The residency index never
trusts them to equal router hashes; it recomputes those from ``token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeAlias


class Medium(StrEnum):
    """Where an engine holds a block: its GPU KV cache or a host (CPU) tier."""

    GPU = "GPU"
    CPU = "CPU"


EngineBlockHash: TypeAlias = int | bytes
"""An engine's own block hash, as it appears on the wire (never compared with router hashes)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became resident. ``token_ids`` covers all blocks, in order.

    ``medium`` ``None`` is what engines from before the medium field send; it means GPU.
    The fields after ``medium`` are optional extensions of newer vLLM versions.
    """

    block_hashes: tuple[EngineBlockHash, ...]
    parent_block_hash: EngineBlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = Medium.GPU.value
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from ``medium`` (``None``: GPU, as for :class:`BlockStored`)."""

    block_hashes: tuple[EngineBlockHash, ...]
    medium: str | None = Medium.GPU.value
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events published together. ``ts`` is the publisher's wall clock (seconds)."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def event_medium(medium: str | None) -> Medium | None:
    """The tier an event's ``medium`` names: ``None`` → GPU; unknown media → ``None``."""
    if medium is None:
        return Medium.GPU
    try:
        return Medium(medium.upper())
    except ValueError:
        return None
