"""The KV router's pull hook: link speed estimate, metrics, and the decision rewrite.

:class:`PullPlanner` sits between :func:`~pdproxy.routing.kv.cost.plan_route` and the
router's charges: it asks :func:`~pdproxy.routing.kv.pull.choose_pull` whether a pull beats
the plan, counts the pulls it chooses, and carries the link speed the cost uses. The speed
starts at the configured ``link_bytes_per_s`` and follows measured pulls (bytes and seconds a
worker reports) as an exponentially weighted moving average.

It also keeps the bytes each holder is sending to the pulls this replica chose and that are
still in flight (from the decision until the request's ``finished``): they queue ahead of the
next pull from that holder. The figure is this replica's own, even with shared state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdproxy.routing.base import B, RouteDecision
from pdproxy.routing.kv.cost import NodeState, Plan, PromptShape
from pdproxy.routing.kv.pull import PulledPlan, PullEndpoint, choose_pull
from pdproxy.routing.kv.pull_settings import PullSettings
from pdproxy.routing.kv.settings import CostWeights

logger = logging.getLogger(__name__)


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


class PullMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pulls = Counter(
            "pdproxy_kv_pulls",
            "Requests routed to a free node that pulls the prompt's prefix from its holder",
            ["holder"],
            registry=registry,
        )
        self.planned_bytes = Counter(
            "pdproxy_kv_pull_planned_bytes",
            "KV bytes the chosen pulls were expected to move (blocks x block_bytes)",
            registry=registry,
        )
        self.measured_bytes = Counter(
            "pdproxy_kv_pull_measured_bytes",
            "KV bytes workers reported pulling (what updates the link speed)",
            registry=registry,
        )
        self.link_speed = Gauge(
            "pdproxy_kv_pull_link_bytes_per_second",
            "Link speed the pull cost uses (configured, then the EWMA of measured pulls)",
            registry=registry,
        )


class PullPlanner:
    def __init__(
        self, settings: PullSettings, weights: CostWeights, registry: CollectorRegistry
    ) -> None:
        self.settings = settings
        self._weights = weights
        self.link = LinkSpeed(settings)
        self.metrics = PullMetrics(registry)
        self.metrics.link_speed.set(self.link.bytes_per_s)
        self.sending: dict[str, int] = {}
        """Bytes each holder is sending to pulls in flight, by holder name."""
        self._in_flight: dict[str, tuple[str, int]] = {}
        """Request id -> (holder, bytes) of each pull in flight."""

    def consider(
        self,
        request_id: str,
        plan: Plan,
        prompt: PromptShape | None,
        producers: Sequence[NodeState],
        consumers: Sequence[NodeState],
        *,
        backends: Sequence[Any],
    ) -> PulledPlan | None:
        """The pull that beats ``plan``, if any; ``backends``: the candidates given to route
        (those that are not :class:`PullEndpoint` take no part)."""
        if not self.settings.enabled:
            return None
        endpoints = {b.name: b for b in backends if isinstance(b, PullEndpoint)}
        pulled = choose_pull(
            plan, prompt, producers, consumers, endpoints=endpoints, weights=self._weights,
            settings=self.settings, link_bytes_per_s=self.link.bytes_per_s, sending=self.sending,
        )  # fmt: skip
        if pulled is not None:
            c = pulled.choice
            self.finished(request_id)  # an id reused while in flight: drop its old pull
            self._in_flight[request_id] = (c.holder, c.nbytes)
            self.sending[c.holder] = self.sending.get(c.holder, 0) + c.nbytes
            self.metrics.pulls.labels(c.holder).inc()
            self.metrics.planned_bytes.inc(c.nbytes)
            logger.debug(
                "pull: %s pulls %d blocks (%d bytes) from %s; cost %.0f vs recompute %.0f, "
                "wait %.0f", c.target, c.blocks, c.nbytes, c.holder, c.cost, c.plan_cost,
                c.wait_cost,
            )  # fmt: skip
        return pulled

    def finished(self, request_id: str) -> None:
        """The request is over: its pull no longer queues ahead of others."""
        pull = self._in_flight.pop(request_id, None)
        if pull is None:
            return
        holder, nbytes = pull
        left = self.sending.get(holder, 0) - nbytes
        if left > 0:
            self.sending[holder] = left
        else:
            self.sending.pop(holder, None)

    def observe(self, nbytes: int, seconds: float) -> None:
        """A worker measured one pull: ``nbytes`` moved in ``seconds``."""
        if self.link.observe(nbytes, seconds):
            self.metrics.measured_bytes.inc(nbytes)
            self.metrics.link_speed.set(self.link.bytes_per_s)
            logger.debug(
                "pull measured: %d bytes in %.4fs; link estimate %.1f MB/s",
                nbytes, seconds, self.link.bytes_per_s / 1e6,
            )  # fmt: skip


def with_pull(decision: RouteDecision[B], pulled: PulledPlan | None) -> RouteDecision[B]:
    """``decision`` carrying the pull's source and its figures in the explanation."""
    if pulled is None:
        return decision
    explain = {**decision.explain, "pull": pulled.choice.explain()}
    return dataclasses.replace(decision, pull=pulled.source, explain=explain)
