"""Read an engine's load from its Prometheus text exposition (pure; never raises on input).

Only the few series the router charges are read, line by line, without a full Prometheus
parse (a vLLM ``/metrics`` page is mostly histograms the router does not need):

============================  ==============================  ===================================
reading                        vLLM                            reference worker (``kvtier``)
============================  ==============================  ===================================
requests waiting               ``vllm:num_requests_waiting``   ``kvtier_worker_waiting_requests``
requests running               ``vllm:num_requests_running``   ``kvtier_worker_running_requests``
KV-cache usage (0..1)          ``vllm:kv_cache_usage_perc``    ``kvtier_worker_kv_usage_ratio``
                               (older: ``gpu_cache_usage_perc``)
============================  ==============================  ===================================

Series of one name are summed over their labels for request counts (a data-parallel engine
exports one series per ``engine``) and maximised for KV usage (the fullest rank or pool is the
one that preempts). A page with neither request count is no reading at all (``None``).

The reference worker's pull counters ``kvtier_worker_pull_bytes_total`` and
``kvtier_worker_pull_seconds_total`` (bytes pulled from holders, and the wall seconds of those
pulls) are read too: their growth between scrapes is the measured link speed
(:mod:`~pdproxy.routing.kv.pull_link`). vLLM's kvtier connector does not pull (it only answers
offers as a holder), so it exports no such counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_WAITING = (b"vllm:num_requests_waiting", b"kvtier_worker_waiting_requests")
_RUNNING = (b"vllm:num_requests_running", b"kvtier_worker_running_requests")
_KV_USAGE = (
    b"vllm:kv_cache_usage_perc",
    b"vllm:gpu_cache_usage_perc",
    b"kvtier_worker_kv_usage_ratio",
)
_PULL_BYTES = (b"kvtier_worker_pull_bytes_total",)
_PULL_SECONDS = (b"kvtier_worker_pull_seconds_total",)
_WANTED = _WAITING + _RUNNING + _KV_USAGE + _PULL_BYTES + _PULL_SECONDS
_MAX_REQUESTS = 1e9
"""A count beyond this is nonsense (or hostile): the line is ignored."""
_MAX_COUNTER = 1e18
"""A pull counter beyond this (an exabyte, or 30 billion years) is nonsense: ignored."""


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What one scrape said about the engine."""

    waiting: int
    running: int
    kv_usage: float | None
    """Fraction of KV-cache in use (0..1), None when the engine does not say."""
    pull_bytes: float | None = None
    """The worker's pull bytes counter, None when it does not export one."""
    pull_seconds: float | None = None
    """The worker's pull seconds counter, None when it does not export one."""


def _series(line: bytes) -> tuple[bytes, float] | None:
    """``name{labels} value [timestamp]`` → (name, value) for a wanted, finite sample."""
    if not line.startswith(_WANTED):
        return None
    brace = line.find(b"{")
    if brace >= 0:
        name = line[:brace]
        close = line.rfind(b"}")
        if close < brace:
            return None
        rest = line[close + 1 :]
    else:
        name, _, rest = line.partition(b" ")
    if name not in _WANTED:
        return None  # a longer name sharing the prefix (e.g. ..._created)
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return name, value


def parse_engine_metrics(text: bytes) -> EngineSample | None:
    """The engine's load from a ``/metrics`` page, or None if the page reports none."""
    waiting = running = 0.0
    saw_waiting = saw_running = False
    usage: float | None = None
    pull_bytes: float | None = None
    pull_seconds: float | None = None
    for raw in text.split(b"\n"):
        parsed = _series(raw.strip())
        if parsed is None:
            continue
        name, value = parsed
        if name in _WAITING and value <= _MAX_REQUESTS:
            waiting += value
            saw_waiting = True
        elif name in _RUNNING and value <= _MAX_REQUESTS:
            running += value
            saw_running = True
        elif name in _KV_USAGE and value <= 1.0:
            usage = value if usage is None else max(usage, value)
        elif name in _PULL_BYTES and value <= _MAX_COUNTER:
            pull_bytes = (pull_bytes or 0.0) + value
        elif name in _PULL_SECONDS and value <= _MAX_COUNTER:
            pull_seconds = (pull_seconds or 0.0) + value
    if not (saw_waiting or saw_running):
        return None
    return EngineSample(
        int(min(waiting, _MAX_REQUESTS)),
        int(min(running, _MAX_REQUESTS)),
        usage,
        pull_bytes,
        pull_seconds,
    )
