"""How far the residency index can be trusted for each node: exact, degraded or stale (state;
fed by :class:`~pdproxy.routing.kv.event_feeds.EventFeeds` and the router, read by the cost).

Derived only from what the event subscriber already knows:

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
from dataclasses import dataclass

from pdproxy.routing.kv.signal_settings import IndexExactnessSettings


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
