"""Settings of symmetric pull (:mod:`pdproxy.routing.kv.pull`): when moving a prefix from its
busy holder beats recomputing it or waiting for the holder.

Everything is converted to prefill-token equivalents, the unit of the cost model: moving
``n`` bytes costs ``n / link_bytes_per_s`` seconds, which a node would otherwise spend
prefilling ``prefill_tokens_per_s`` tokens per second.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PullSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=False,
        description="route to a free node that pulls the prompt's prefix from its busy holder "
        "(p2p dialect only; the holder needs a configured kv_address and a P2P server)",
    )
    block_bytes: int = Field(
        default=2 * 1024 * 1024,
        gt=0,
        description="KV bytes of one block over all layers (16 tokens of a Llama-3-8B in bf16: "
        "32 layers x K,V x 8 heads x 128 x 2 bytes x 16 = 2 MiB)",
    )
    link_bytes_per_s: float = Field(
        default=1.25e9,
        gt=0.0,
        description="node-to-node P2P speed assumed until pulls are measured (10 Gb/s)",
    )
    prefill_tokens_per_s: float = Field(
        default=8000.0,
        gt=0.0,
        description="prefill throughput of one node: converts transfer seconds into the cost "
        "model's token equivalents",
    )
    setup_tokens: float = Field(
        default=64.0,
        ge=0.0,
        description="fixed cost of one pull (connection, handshake, offer round trip)",
    )
    min_blocks: int = Field(
        default=4, ge=1, description="pull only when the holder has this many more blocks"
    )
    min_gain_tokens: float = Field(
        default=64.0,
        ge=0.0,
        description="pull only when it beats the plan's choice by this many token equivalents",
    )
    ewma_alpha: float = Field(
        default=0.2,
        gt=0.0,
        le=1.0,
        description="weight of each measured pull in the link speed estimate",
    )
    min_sample_bytes: int = Field(
        default=64 * 1024,
        ge=0,
        description="measured pulls smaller than this do not update the link speed (latency, "
        "not bandwidth, dominates them)",
    )
