"""Settings of the router's two outside signals: engine-reported load (scraped from each
backend's Prometheus ``/metrics``) and per-node index exactness (derived from the KV event
stream). Embedded in :class:`~pdproxy.routing.kv.settings.KvRouterSettings` as
``engine_load`` and ``index_exactness``; nothing here reads the environment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineLoadSettings(BaseModel):
    """Scrape each backend's ``/metrics`` (vLLM's ``vllm:num_requests_waiting``,
    ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` or the reference worker's
    ``kvtier_worker_*`` equivalents) and charge what the engine reports beyond this proxy's
    own requests. Off by default: it is I/O against every backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    path: str = Field(default="/metrics", description="scraped path on each backend's URL")
    interval_s: float = Field(default=1.0, gt=0.0, le=60.0, description="time between scrapes")
    jitter: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="each wait is interval_s x (1 ± jitter), so proxy replicas do not scrape "
        "in lockstep",
    )
    timeout_s: float = Field(
        default=0.5, gt=0.0, description="bound on one scrape, connect to last byte"
    )
    max_bytes: int = Field(
        default=2 * 1024 * 1024,
        ge=1024,
        description="a response longer than this is abandoned (a hostile or broken backend "
        "cannot grow the proxy's memory)",
    )
    concurrency: int = Field(default=8, ge=1, description="scrapes in flight at once")
    stale_intervals: float = Field(
        default=3.0,
        gt=0.0,
        description="a reading older than this many intervals is ignored: the node is charged "
        "by this proxy's own in-flight count alone",
    )
    waiting_request_tokens: float = Field(
        default=256.0,
        ge=0.0,
        description="cost of each request the engine reports waiting (not yet scheduled), on "
        "top of its in-flight charge: a new request would queue behind it",
    )
    kv_usage_knee: float = Field(
        default=0.8,
        ge=0.0,
        lt=1.0,
        description="KV-cache usage above which a node is charged (preemption risk)",
    )
    kv_usage_tokens: float = Field(
        default=512.0,
        ge=0.0,
        description="charge at 100% KV-cache usage, rising linearly from the knee",
    )


class IndexExactnessSettings(BaseModel):
    """How much a node's cached blocks are credited when its event stream is not exact.

    ``exact``: every event delivered in order. ``degraded``: a sequence gap (or a dropped
    connection) is being replayed. ``stale``: events were lost for good, or the node was sent
    work that should have produced events and stayed silent for ``silence_s``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    degraded_credit: float = Field(
        default=0.5, ge=0.0, le=1.0, description="share of a degraded node's match credited"
    )
    stale_credit: float = Field(
        default=0.0, ge=0.0, le=1.0, description="share of a stale node's match credited"
    )
    silence_s: float = Field(
        default=10.0,
        gt=0.0,
        description="a node routed uncached blocks that publishes no event for this long is "
        "stale (its events are lost somewhere; an idle node is never stale)",
    )
    settle_s: float = Field(
        default=2.0,
        ge=0.0,
        description="after events were lost for good, the node is stale until a batch arrives "
        "in sequence at least this long after the loss",
    )
