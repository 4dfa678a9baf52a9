"""Settings of the KV-aware router: cost weights, thresholds, shared state, deadlines.

A plain pydantic model so the proxy's settings can embed it (``kv_router: KvRouterSettings``);
nothing here reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdproxy.routing.kv.affinity import AffinitySettings
from pdproxy.routing.kv.pull_settings import PullSettings
from pdproxy.routing.kv.signal_settings import EngineLoadSettings, IndexExactnessSettings
from pdproxy.tokenize.settings import TokenizerSettings


class CostWeights(BaseModel):
    """Weights of the cost model; every cost is in *prefill-token equivalents*.

    A node's cost estimates the time until the request's first token in units of the time to
    prefill one token. Cached blocks earn credit by tier: a GPU block saves its whole prefill
    (1.0), a host-tier block most of it (0.8: it still has to be copied host → GPU), a block only
    predicted (routed there, not yet confirmed by events) slightly less than a GPU block.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_credit: float = Field(default=1.0, ge=0.0, le=1.0)
    host_credit: float = Field(default=0.8, ge=0.0, le=1.0)
    predicted_credit: float = Field(default=0.9, ge=0.0, le=1.0)
    in_flight_tokens: float = Field(
        default=128.0,
        ge=0.0,
        description="cost of one request in flight on a node (token equivalents)",
    )
    queued_token_weight: float = Field(
        default=1.0, ge=0.0, description="weight of prefill tokens already queued on a node"
    )
    p2p_block_tokens: float = Field(
        default=1.6,
        ge=0.0,
        description="cost for a consumer to fetch one block over P2P (a 16-token "
        "block costs about a tenth of computing it)",
    )


class LocalPrefillThresholds(BaseModel):
    """Conditional disaggregation: when the consumer alone should prefill."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_suffix_tokens: int = Field(
        default=256,
        ge=0,
        description="uncached suffix on the chosen consumer at or below this: no producer",
    )
    min_hit_ratio: float = Field(
        default=0.9,
        ge=0.0,
        le=1.0,
        description="consumer holds at least this share of the prompt's "
        "blocks: no producer (1.0 disables)",
    )


class EventsCurveSettings(BaseModel):
    """ZMQ CURVE keys for the KV event subscriptions (certificate files written by
    ``python -m kvtier.events.curve``). With them, every subscription is encrypted and
    authenticated; a backend with no server key configured is not subscribed at all."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    client_secret_key_file: Path = Field(
        description="this proxy's secret certificate (NAME.key_secret; its NAME.key goes into "
        "each worker's events_curve_clients_dir)"
    )
    server_public_key_file: Path | None = Field(
        default=None, description="the workers' public certificate, when they share one"
    )
    server_public_key_files: dict[str, Path] = Field(
        default_factory=dict,
        description="backend name -> its worker's public certificate (over the shared one)",
    )


class KvRouterSettings(BaseModel):
    """Everything the KV-aware router is configured with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_seed: str = Field(default="default", description="seed naming the model in block hashes")
    block_size: int = Field(default=16, gt=0)
    max_route_blocks: int = Field(
        default=2048,
        ge=1,
        description="most leading blocks of a prompt hashed, matched and predicted per request "
        "(2048 x 16 = 32k tokens: the decision routes on that prefix). Bounds the event loop's "
        "work for one request: ~1.5 ms hashing, ~4 ms predicting at 2048 blocks here",
    )
    inline_hash_blocks: int = Field(
        default=2048,
        ge=0,
        description="prompts with more blocks than this are hashed in a thread. Hashing is a "
        "Python loop that holds the GIL in a thread too (Python switches threads every 5 ms), "
        "so a thread frees the loop only for hashing longer than that and otherwise adds two "
        "wake-ups: a 512-block decision took 0.30 ms inline, 0.51 ms through a thread (p50)",
    )
    weights: CostWeights = Field(default_factory=CostWeights)
    local_prefill: LocalPrefillThresholds = Field(default_factory=LocalPrefillThresholds)
    prediction_ttl_s: float = Field(
        default=2.0, gt=0.0, description="lifetime of speculative residency written at routing time"
    )
    hotspot_max_imbalance: int = Field(
        default=8,
        ge=0,
        description="a node more than this many in-flight requests above the least "
        "loaded candidate of its role is not chosen, whatever it holds",
    )
    index_url: str | None = Field(
        default=None,
        description="redis://... to share residency, predictions and load across proxies; "
        "None keeps everything in this process",
    )
    key_prefix: str = Field(
        default="pdproxy", description="Redis key prefix (hash-tagged per model)"
    )
    redis_deadline_s: float = Field(default=0.02, gt=0.0, description="bound on each Redis call")
    breaker_failures: int = Field(
        default=3, ge=1, description="consecutive Redis failures that open the breaker"
    )
    breaker_cooldown_s: float = Field(
        default=0.5, gt=0.0, description="how long an open breaker waits before one probe call"
    )
    replica_ttl_s: float = Field(
        default=5.0,
        gt=0.0,
        description="a proxy replica whose heartbeat is older than this no longer "
        "counts in shared load",
    )
    event_lease_ttl_s: float = Field(
        default=3.0,
        gt=0.0,
        description="shared mode: one replica writes each worker's KV events under a lease of "
        "this TTL (renewed every third of it); when that replica dies another takes the "
        "stream over within about 1.3x this",
    )
    events: dict[str, str] = Field(
        default_factory=dict, description="backend name -> its KV event endpoint (ZMQ PUB)"
    )
    replay: dict[str, str] = Field(
        default_factory=dict, description="backend name -> its KV event replay endpoint"
    )
    tokenizer: TokenizerSettings = Field(default_factory=TokenizerSettings)
    events_curve: EventsCurveSettings | None = Field(
        default=None,
        description="CURVE keys for the event sockets (they carry prompt token ids); None: "
        "plain ZMQ, for a private network only",
    )
    pd_cached_tokens: Literal["prompt", "consumer_local"] = Field(
        default="prompt",
        description="what a consumer reports as cached_tokens after a PD transfer, for the "
        "drift metric: prompt (kvtier workers count fetched blocks) or consumer_local (vLLM's "
        "NixlConnector counts only the consumer's own prefix-cache hits)",
    )
    affinity: AffinitySettings = Field(
        default_factory=AffinitySettings,
        description="session affinity (x-session-id or the OpenAI user field), per replica",
    )
    engine_load: EngineLoadSettings = Field(
        default_factory=EngineLoadSettings,
        description="engine-reported load scraped from each backend's /metrics (off by default)",
    )
    index_exactness: IndexExactnessSettings = Field(
        default_factory=IndexExactnessSettings,
        description="discount of a node's match while its KV event stream is not exact",
    )
    pull: PullSettings = Field(
        default_factory=PullSettings,
        description="symmetric pull: a free node pulls the prefix from its busy holder",
    )
