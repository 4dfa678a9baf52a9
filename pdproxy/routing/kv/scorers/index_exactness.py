"""Index exactness: how far the residency index can be trusted for each node (exact, degraded
or stale), and the discount of a node's credited match while its KV event stream is not exact
(``index_exactness.degraded_credit``, ``stale_credit``).

The state machine is fed by :class:`~pdproxy.routing.kv.event_feeds.EventFeeds` (the I/O) and by
the router's decisions (:meth:`Scorer.record`: a node sent blocks it does not hold must publish
events), and read by each decision's view. Derived only from what the event subscriber already
knows:

- ``exact``: every batch delivered in sequence.
- ``degraded``: a sequence gap was seen (or the connection to the publisher dropped) and the
  batches in between are being replayed. Back to exact once a batch at or past the one that
  revealed the gap has been delivered (the replay filled it).
- ``stale``: events were lost for good (the subscriber's reset: no replay socket, replay buffer
  too short, replay timed out, publisher restarted), or the node was routed blocks it did not
  hold (work that must produce ``BlockStored``) and published nothing for ``silence_s``. An
  idle node is never stale. Stale after a loss lasts until a batch arrives in sequence at least
  ``settle_s`` after the loss; stale from silence ends with the next batch delivered in
  sequence (the events were late, not lost; a gap goes the degraded way).

Times are the caller's monotonic clock, passed in: the state machine itself does no I/O.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.kv.plan import NO_MATCH
from pdproxy.routing.kv.scorers.base import Ask, Made, Scorer, View, rows
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import IndexExactnessSettings


class Exactness(enum.IntEnum):
    """Gauge values: 0 exact, 1 degraded, 2 stale."""

    EXACT = 0
    DEGRADED = 1
    STALE = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class NodeExactness:
    state: Exactness
    event_age_s: float | None
    """Seconds since the node's last delivered batch (None: none yet)."""
    reason: str
    """What put the node in this state (``in-sequence``, ``gap``, ``disconnected``,
    ``lost``, ``silent``)."""


EXACT = NodeExactness(Exactness.EXACT, None, "untracked")


@dataclass(slots=True)
class _Node:
    state: Exactness = Exactness.EXACT
    reason: str = "in-sequence"
    since: float = 0.0
    last_event: float | None = None
    gap_seq: int | None = None
    """Degraded by a gap: the live sequence that revealed it (None: by a disconnect)."""
    expecting_since: float | None = None
    """When the router first sent the node uncached blocks with no batch delivered since."""


class IndexExactness:
    """Per-node exactness of the index, one state machine per followed event stream."""

    def __init__(self, settings: IndexExactnessSettings) -> None:
        self.settings = settings
        self._nodes: dict[str, _Node] = {}

    # -- the event stream ----------------------------------------------------------------------

    def track(self, node: str, now: float) -> None:
        """A subscription to ``node``'s events started (a fresh stream: exact, empty)."""
        self._nodes[node] = _Node(since=now)

    def untrack(self, node: str) -> None:
        self._nodes.pop(node, None)

    def gap(self, node: str, seen_seq: int | None, now: float) -> None:
        """A gap before ``seen_seq`` (None: the connection dropped) is about to be replayed."""
        n = self._nodes.get(node)
        if n is None or n.state is Exactness.STALE:
            return  # stale stays stale until its own exit condition
        self._enter(n, Exactness.DEGRADED, "gap" if seen_seq is not None else "disconnected", now)
        if seen_seq is None or n.gap_seq is None:
            n.gap_seq = seen_seq
        else:
            n.gap_seq = max(n.gap_seq, seen_seq)

    def lost(self, node: str, now: float) -> None:
        """Events were lost for good (the subscriber reset)."""
        n = self._nodes.get(node)
        if n is None:
            return
        self._enter(n, Exactness.STALE, "lost", now)
        n.since = now  # each further loss restarts the settling time
        n.gap_seq = None

    def delivered(self, node: str, seq: int, now: float) -> None:
        """Batch ``seq`` reached the index (live or replayed)."""
        n = self._nodes.get(node)
        if n is None:
            return
        n.last_event = now
        n.expecting_since = None
        if n.state is Exactness.DEGRADED and n.gap_seq is not None and seq >= n.gap_seq:
            self._enter(n, Exactness.EXACT, "in-sequence", now)
            n.gap_seq = None
        elif n.state is Exactness.STALE and (
            n.reason == "silent" or now - n.since >= self.settings.settle_s
        ):
            self._enter(n, Exactness.EXACT, "in-sequence", now)

    # -- the router ----------------------------------------------------------------------------

    def expect(self, node: str, now: float) -> None:
        """The router sent ``node`` blocks it did not hold: events should follow."""
        n = self._nodes.get(node)
        if n is not None and n.expecting_since is None:
            n.expecting_since = now

    def of(self, node: str, now: float) -> NodeExactness:
        n = self._nodes.get(node)
        if n is None:
            return EXACT
        age = None if n.last_event is None else max(now - n.last_event, 0.0)
        if (
            n.state is not Exactness.STALE
            and n.expecting_since is not None
            and now - n.expecting_since >= self.settings.silence_s
        ):
            # Decided at read time so that a silent node needs no timer to turn stale.
            self._enter(n, Exactness.STALE, "silent", n.expecting_since + self.settings.silence_s)
            n.gap_seq = None
        return NodeExactness(n.state, age, n.reason)

    def credit_factor(self, node: str, now: float) -> float:
        """Share of the node's match the cost credits."""
        if not self.settings.enabled:
            return 1.0
        state = self.of(node, now).state
        if state is Exactness.DEGRADED:
            return self.settings.degraded_credit
        if state is Exactness.STALE:
            return self.settings.stale_credit
        return 1.0

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    @staticmethod
    def _enter(n: _Node, state: Exactness, reason: str, now: float) -> None:
        if n.state is not state or n.reason != reason:
            n.since = now
        n.state = state
        n.reason = reason


def discounted_match(match: Match, factor: float) -> Match:
    """``match`` with every count scaled by ``factor`` (rounded down), predictions included:
    a prediction waits for events to confirm it, and a node whose events are not arriving can
    neither confirm nor refute one (in the exactness benchmark, keeping them at full credit
    left a silent node's wrong-route rate at 30% instead of about 1%)."""
    if factor >= 1.0:
        return match
    factor = max(factor, 0.0)
    return Match(
        gpu=math.floor(match.gpu * factor),
        cpu=math.floor(match.cpu * factor),
        total=math.floor(match.total * factor),
        predicted=math.floor(match.predicted * factor),
    )


@dataclass(frozen=True, slots=True)
class ExactnessView(View):
    factors: Mapping[str, float]
    """Share of each candidate's match credited (absent: 1.0)."""

    def credit(self, node: str, match: Match) -> Match:
        return discounted_match(match, self.factors.get(node, 1.0))


class _ExactnessCollector(Collector):
    def __init__(self, exactness: IndexExactness, clock: Callable[[], float]) -> None:
        self._exactness = exactness
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        gauge = GaugeMetricFamily(
            "pdproxy_kv_index_exactness",
            "Trust in a node's KV residency: 0 exact, 1 degraded (an event gap being "
            "replayed), 2 stale (events lost for good, or silent while work was sent)",
            labels=["node"],
        )
        age = GaugeMetricFamily(
            "pdproxy_kv_index_event_age_seconds",
            "Seconds since a node's last KV event batch was delivered",
            labels=["node"],
        )
        for node in self._exactness.nodes():
            state = self._exactness.of(node, now)
            gauge.add_metric([node], int(state.state))
            if state.event_age_s is not None:
                age.add_metric([node], state.event_age_s)
        yield gauge
        yield age


class IndexExactnessScorer(Scorer[ExactnessView]):
    name = "index_exactness"

    def __init__(self, exactness: IndexExactness) -> None:
        self.exactness = exactness
        """The per-node state machine (the KV event feeds write it)."""

    def observe(self, ask: Ask) -> ExactnessView:
        names = {b.name for b in ask.candidates}
        return ExactnessView({n: self.exactness.credit_factor(n, ask.now) for n in sorted(names)})

    def record(self, made: Made, view: ExactnessView) -> None:
        """Nodes sent blocks their confirmed residency lacks must publish events soon."""
        prompt, plan = made.prompt, made.plan
        if prompt is None or prompt.blocks == 0:
            return
        chosen = [plan.consumers[0]] if plan.consumers else []
        if plan.producers:
            chosen.append(plan.producers[0])
        for node in chosen:
            if made.matches.get(NodeId(node), NO_MATCH).total < prompt.blocks:
                self.exactness.expect(node, made.now)

    def annotate(self, explain: Mapping[str, Any], now: float) -> None:
        for row in rows(explain):
            state = self.exactness.of(str(row.get("name")), now)
            row["exactness"] = state.state.label
            if state.event_age_s is not None:
                row["event_age_s"] = round(state.event_age_s, 1)


def build(
    settings: KvRouterSettings,
    registry: CollectorRegistry,
    clock: Callable[[], float] = time.monotonic,
) -> IndexExactnessScorer:
    exactness = IndexExactness(settings.index_exactness)
    registry.register(_ExactnessCollector(exactness, clock))
    return IndexExactnessScorer(exactness)
