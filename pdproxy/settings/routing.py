"""``router_options``: the KV-aware router's settings, one typed tree validated with the config.

:class:`KvRouterSettings` is the type of ``router_options`` and of each model's
``models.served.<name>.router_options`` (an override: only the keys it sets count, see
:meth:`KvRouterSettings.over`). Its scorers' sections (``weights``, ``affinity``,
``engine_load``, ``index_exactness``, ``pull``) are in :mod:`pdproxy.settings.scorers`; the
tokenizer's here, since a router tokenizes its model's prompts. An error names the key path:
``router_options.pull.link_bytes_per_s: Input should be greater than 0``.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdproxy.settings.scorers import (
    AffinitySettings,
    CostWeights,
    EngineLoadSettings,
    IndexExactnessSettings,
    PullSettings,
    TtftSettings,
)

# kvtier's defaults, written out: loading the settings loads no part of the runtime (zmq).
# tests/pdproxy/routing/test_kv_event_floods.py checks they still match.
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""``kvtier.events.subscriber.DEFAULT_MAX_MESSAGE_BYTES``."""
DEFAULT_MAX_BLOCKS_PER_NODE = 1 << 18
"""``kvtier.residency.translate.DEFAULT_MAX_BLOCKS_PER_NODE``."""


class TokenizerKind(StrEnum):
    BYTES = "bytes"
    """UTF-8 bytes as token ids: the reference worker's tokenizer."""
    HF = "hf"
    """A local Hugging Face ``tokenizer.json`` (chat template from ``tokenizer_config.json``)."""
    BACKEND = "backend"
    """The backend's own ``POST /tokenize`` endpoint."""


class TokenizerSettings(BaseModel):
    """How a backend pool's prompts are turned into token ids (:mod:`pdproxy.tokenize`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: TokenizerKind = TokenizerKind.BYTES
    path: str | None = Field(
        default=None, description="hf: directory holding tokenizer.json and tokenizer_config.json"
    )
    url: str | None = Field(default=None, description="backend: base URL whose /tokenize is called")
    model: str | None = Field(default=None, description="backend: model name sent to /tokenize")
    timeout_s: float = Field(
        default=0.5, gt=0.0, description="backend: bound on one /tokenize call"
    )
    offload_threshold_chars: int = Field(
        default=16_384,
        ge=0,
        description="prompts longer than this are tokenized off the event loop",
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

    @property
    def always_disaggregated(self) -> bool:
        """Neither rule ever sends an uncached suffix to a consumer alone."""
        return self.max_suffix_tokens == 0 and self.min_hit_ratio >= 1.0


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
    """Everything the KV-aware router is configured with (``router_options``).

    Read as a mapping (``keys()``, ``[key]``, ``dict(options)``, ``**options``) it shows the
    options as written, the keys the operator set: what scripts written against the untyped
    ``router_options`` of earlier versions read."""

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
    event_max_message_bytes: int = Field(
        default=DEFAULT_MAX_MESSAGE_BYTES,
        gt=0,
        description="largest KV event message read (live and replay sockets); a larger one "
        "drops its connection unread (ZMQ_MAXMSGSIZE) and counts as a disconnect or a replay "
        "timeout of its node",
    )
    max_blocks_per_node: int = Field(
        default=DEFAULT_MAX_BLOCKS_PER_NODE,
        ge=1,
        description="router blocks indexed per node from its events; past it the node's "
        "oldest blocks are forgotten (pdproxy_kv_router_index_evicted_blocks)",
    )
    event_apply_blocks: int = Field(
        default=1024,
        ge=1,
        description="a KV event batch is applied in slices of about this many blocks, the "
        "event loop free between slices (a 4 MiB batch must not stall other requests)",
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
        description="symmetric pull: a free node pulls the prompt's prefix from its busy holder",
    )
    ttft: TtftSettings = Field(
        default_factory=TtftSettings,
        description="predicted time to first token: targets per class, routing, PD bypass and "
        "shedding by prediction",
    )

    def over(self, own: KvRouterSettings) -> KvRouterSettings:
        """These settings with the keys ``own`` sets replaced by its values (a model's options
        over the top-level ones). A section replaces the whole section: ``own`` setting
        ``weights: {gpu_credit: 0.5}`` leaves the other weights at their defaults."""
        return self.model_copy(update={key: getattr(own, key) for key in own.model_fields_set})
