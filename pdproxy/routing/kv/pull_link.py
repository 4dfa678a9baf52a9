"""The link speed the pull cost uses, and the measured pulls that teach it.

:class:`LinkSpeed` starts at the configured ``pull.link_bytes_per_s`` and follows measured pulls
as an exponentially weighted moving average. A pull is measured from the workers' counters: the
growth of a node's ``pull_bytes`` and ``pull_seconds`` between two scrapes is the bytes its
pulls moved and the wall time they took (:class:`PullCounters`; state only: the engine-load
scrape reads the counters, the pull scorer folds what this yields into its link speed).

Threat model: the counters come from an untrusted ``/metrics`` answer. A backend can bias the
link speed the pull cost uses (as it could by pulling slowly), never raise or grow memory:
values the parser did not accept (negative, NaN, beyond its cap) never get here, a counter
that went down (a worker restart) only replaces the baseline, and a rate beyond
:data:`MAX_BYTES_PER_S` is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdproxy.routing.kv.engine_metrics_text import EngineSample
from pdproxy.settings.scorers import PullSettings

MAX_BYTES_PER_S = 1e13
"""10 TB/s: no link between two nodes moves KV faster; a delta claiming more is ignored."""


@dataclass(frozen=True, slots=True)
class PullMeasurement:
    """Pulls one node made since its previous reading: ``nbytes`` moved in ``seconds``."""

    nbytes: int
    seconds: float


class PullCounters:
    """The last pull counters of each node."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float]] = {}

    def update(self, node: str, sample: EngineSample) -> PullMeasurement | None:
        """The pulls measured since ``node``'s previous reading, or None: a first reading, a
        page without the counters, a reset (either counter went down), no growth of both, or
        an impossible rate."""
        now_bytes, now_seconds = sample.pull_bytes, sample.pull_seconds
        if now_bytes is None or now_seconds is None or not _counters(now_bytes, now_seconds):
            self._last.pop(node, None)
            return None
        previous = self._last.get(node)
        self._last[node] = (now_bytes, now_seconds)
        if previous is None:
            return None
        nbytes = now_bytes - previous[0]
        seconds = now_seconds - previous[1]
        if not (nbytes > 0.0 and seconds > 0.0):
            return None  # no pull since, or a restart (the new values are the baseline)
        if not nbytes / seconds <= MAX_BYTES_PER_S:  # NaN or infinite fail too
            return None
        return PullMeasurement(int(nbytes), seconds)

    def forget(self, node: str) -> None:
        self._last.pop(node, None)

    def nodes(self) -> list[str]:
        return sorted(self._last)


def _counters(*values: float) -> bool:
    """Counter values to keep (the parser already refuses others; this holds without it)."""
    return all(math.isfinite(v) and v >= 0.0 for v in values)


class LinkSpeed:
    """Bytes per second between nodes: the configured value until pulls are measured."""

    def __init__(self, settings: PullSettings) -> None:
        self._settings = settings
        self.bytes_per_s = settings.link_bytes_per_s
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> bool:
        """Fold one measured pull in; False when it is too small or malformed to count."""
        if nbytes < max(self._settings.min_sample_bytes, 1) or not seconds > 0.0:
            return False
        rate = nbytes / seconds
        alpha = self._settings.ewma_alpha
        self.bytes_per_s = (
            rate if self.samples == 0 else (alpha * rate + (1.0 - alpha) * self.bytes_per_s)
        )
        self.samples += 1
        return True
