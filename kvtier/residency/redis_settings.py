"""Settings of :class:`kvtier.residency.redis_index.RedisIndex` (env prefix
``KVTIER_RESIDENCY_``; read only when a caller builds them, never at import)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvtier.residency.redis_layout import MAX_SLOTS
from kvtier.residency.translate import DEFAULT_MAX_BLOCKS_PER_NODE


class RedisIndexSettings(BaseSettings):
    """Connection and deadlines of :class:`RedisIndex` (env prefix ``KVTIER_RESIDENCY_``)."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_RESIDENCY_")

    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL; redis+cluster://host:port for a Redis Cluster",
    )
    namespace: str = Field(default="kvtier", description="first part of the per-model hash tag")
    deadline_s: float | None = Field(
        default=0.05,
        gt=0,
        description="deadline of match/predict/forget/nodes; None when the caller bounds each "
        "call itself (the router's store guard)",
    )
    apply_deadline_s: float = Field(default=0.5, gt=0, description="deadline of one apply call")
    max_connections: int = Field(default=64, gt=0, description="connection pool size")
    group_idx: int = Field(default=0, ge=0, description="KV-cache group whose events are indexed")
    max_node_slots: int = Field(
        default=MAX_SLOTS,
        ge=1,
        le=MAX_SLOTS,
        description="most node slots per model, live and retired together",
    )
    max_blocks_per_call: int = Field(
        default=256,
        ge=1,
        le=8192,
        description="most blocks one write script call names (apply, predict: bounds the time "
        "one call holds Redis; longer prompts and batches take several calls)",
    )
    max_blocks_per_node: int = Field(
        default=DEFAULT_MAX_BLOCKS_PER_NODE,
        ge=1,
        description="router blocks indexed per node; past it the node's oldest blocks are "
        "forgotten (kvtier.residency.translate) and counted (translate_stats(node).evicted)",
    )
    max_blocks_per_read: int = Field(
        default=512,
        ge=1,
        le=8192,
        description="most blocks one match read names (reads cost less per block than writes)",
    )
