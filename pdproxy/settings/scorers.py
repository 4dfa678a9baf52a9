"""Settings of the KV router's scorers (:mod:`pdproxy.routing.kv.scorers`), one class per signal.

They live here, not in the scorer's own file, because the settings tree imports no runtime
module (Rule 1 of :mod:`pdproxy.settings`) and the settings layer sits below routing
(``tests/pdproxy/test_layout.py``): ``router_options`` is validated when the config is loaded.

Every cost is in *prefill-token equivalents* (see :class:`CostWeights`); a scorer's weights are
its settings. Checks live on the fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CostWeights(BaseModel):
    """Weights of the prefix and load scorers; every cost is in *prefill-token equivalents*.

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


class AffinitySettings(BaseModel):
    """Session affinity (``x-session-id`` or the OpenAI ``user`` field), per replica."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(default=True, description="requests without a session are unaffected")
    ttl_s: float = Field(default=600.0, gt=0.0, description="a session forgotten after this idle")
    max_sessions: int = Field(default=65536, ge=1, description="table cap (LRU eviction)")


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


class PullSettings(BaseModel):
    """Symmetric pull: when moving a prefix from its busy holder beats recomputing it or waiting
    for the holder. Moving ``n`` bytes costs ``n / link_bytes_per_s`` seconds, which a node would
    otherwise spend prefilling ``prefill_tokens_per_s`` tokens per second: that converts it into
    the cost model's token equivalents."""

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


class TtftClass(BaseModel):
    """A class of requests by their time-to-first-token target (``interactive``, ``batch``...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_ms: float | None = Field(
        default=None,
        gt=0.0,
        description="TTFT target; None: no target (routed to the lowest predicted TTFT)",
    )
    sheddable: bool = Field(
        default=False,
        description="refused at once (429 + Retry-After) when no candidate is predicted to "
        "meet its target, rather than queued to miss it",
    )
    yields: bool = Field(
        default=False,
        description="placed only where the prefill queue ahead of it is within yield_share of "
        "the tightest target of the classes that do not yield (batch yields to interactive)",
    )
    placement: Literal["fastest", "headroom"] = Field(
        default="fastest",
        description="among candidates meeting the target: the fastest, or the one that keeps "
        "the fast nodes free (the slowest still within the target's headroom_share)",
    )


def _default_classes() -> dict[str, TtftClass]:
    return {
        "interactive": TtftClass(),
        "batch": TtftClass(sheddable=True, yields=True, placement="headroom"),
    }


class TtftSettings(BaseModel):
    """Predicted time to first token (:mod:`pdproxy.routing.kv.latency`): per candidate pair, in
    milliseconds, from rates learned per node from observed leg timings. Routes to the lowest
    prediction that meets the request's target, bypasses the producer when the consumer alone is
    predicted faster, refuses sheddable requests no candidate can serve in time. Until the
    pool has learned its rates (cold start) the cost model and its thresholds decide."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    classes: dict[str, TtftClass] = Field(default_factory=_default_classes)
    default_class: str = Field(
        default="interactive", description="the class of a request whose key names none"
    )
    warm_samples: int = Field(
        default=4,
        ge=1,
        description="observed legs before a node's rate is trusted; until some node of the "
        "pool has this many, predictions are cold and the cost model decides",
    )
    window_samples: float = Field(
        default=32.0,
        ge=2.0,
        description="observations weigh 1/e after this many newer ones (how fast a rate "
        "follows a node whose speed changed)",
    )
    seed_prefill_ms_per_token: float = Field(
        default=0.1, gt=0.0, description="prefill time of a token on a node nothing is known of"
    )
    seed_leg_ms: float = Field(
        default=5.0, ge=0.0, description="fixed time of a leg on a node nothing is known of"
    )
    seed_first_step_ms: float = Field(
        default=20.0,
        ge=0.0,
        description="a PD consumer's time from its leg to its first token, KV transfer aside",
    )
    seed_fetch_ms_per_block: float = Field(
        default=0.05, ge=0.0, description="a PD consumer's time to fetch one missing block"
    )
    max_leg_ms: float = Field(
        default=120_000.0,
        gt=0.0,
        description="observed legs longer than this are clipped (one stall cannot poison a rate)",
    )
    max_fixed_ms: float = Field(
        default=200.0,
        gt=0.0,
        description="most a learned line's fixed part (a leg's overhead, a consumer's first "
        "step) may be: beyond it the time is put down to work, not to start-up",
    )
    headroom_share: float = Field(
        default=0.8,
        gt=0.0,
        le=1.0,
        description="placement=headroom: candidates predicted within this share of the target",
    )
    explore_share: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="ways predicted within this share of the fastest are ties, won by the way "
        "whose node holds most of the prompt, then by the node observed longest ago (how a "
        "node believed slow gets the work that shows it is not); a prediction that beats the "
        "cost model's choice by no more than this keeps the cost model's",
    )
    relearn_s: float = Field(
        default=10.0,
        gt=0.0,
        description="a node's learned rate drifts toward the pool's fastest while the node "
        "goes unobserved, 1/e of the way after this long: a slow node is tried again now and "
        "then, so one that got faster is found",
    )
    yield_share: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="a yielding request starts only on a node whose prefill queue ahead of it "
        "is within this share of the tightest non-yielding target",
    )
    max_nodes: int = Field(default=4096, ge=1, description="nodes whose rates are kept")
    bypass: bool | None = Field(
        default=None,
        description="true: once warm, the prediction decides whether the consumer prefills "
        "alone, with any way; false: `local_prefill`'s thresholds "
        "decide that and the prediction ranks only the ways of the kind they chose. Unset: the "
        "prediction overturns the thresholds' kind only with a way it has learned for the "
        "request's work (not a seed, not an extrapolation), and never when "
        "`local_prefill` keeps every request disaggregated (`max_suffix_tokens: 0, "
        "min_hit_ratio: 1.0`: an operator's always-disaggregated pool stays so)",
    )

    @model_validator(mode="after")
    def _default_class_exists(self) -> TtftSettings:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes")
        return self

    def protected_ms(self) -> float | None:
        """The tightest target among the classes that do not yield (None: none has one)."""
        targets = [c.target_ms for c in self.classes.values() if not c.yields and c.target_ms]
        return min(targets) if targets else None
