"""Counters of the engine and its KV transfers (exported by the server's /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.worker.latency import TokenLatencies


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters; the server turns them into Prometheus metrics."""

    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    failed_requests: int = 0
    recomputed_tokens: int = 0
    """Tokens a consumer leg computed although its producer was expected to supply their KV."""
    p2p_bytes_fetched: int = 0
    p2p_blocks_fetched: int = 0
    p2p_fetch_failures: int = 0
    """Consumer legs whose fetch failed in part or whole (the missing range was recomputed)."""
    kv_params_fallbacks: int = 0
    """Legs whose kv_transfer_params were malformed or unreachable; they ran locally."""
    p2p_blocks_supplied: int = 0
    """Blocks a producer leg offered to the P2P tier."""
    kv_params_refused: int = 0
    """Legs refused with 400: an id over the length cap, or a producer outside
    ``p2p_allowed_peers``."""
    unauthorized_requests: int = 0
    """Requests refused with 401: no or a wrong bearer key."""
    oversized_bodies: int = 0
    """Requests refused with 413: a body over ``max_body_bytes``."""
    pull_requests: int = 0
    """Legs that asked a holder for prefix blocks they lacked (``remote_kv_source``)."""
    pull_blocks: int = 0
    """Blocks pulled from holders (installed in host pages, then on the device)."""
    pull_bytes: int = 0
    pull_failures: int = 0
    """Pulls that ended short of the blocks the leg could use for a transport, verification or
    deadline problem (holder unreachable, refused or broken off); the rest was recomputed."""
    pull_short: int = 0
    """Pulls whose holder held fewer blocks than asked (it lacks the tail; not a failure)."""
    pull_seconds: float = 0.0
    """Wall seconds of the pulls that moved bytes (offer, fetch and done): with ``pull_bytes``
    the link speed the router learns from ``/metrics``."""
    latencies: TokenLatencies = field(default_factory=TokenLatencies)
    """Per-token latency histograms (exported as ``kvtier_worker_*_seconds``)."""
