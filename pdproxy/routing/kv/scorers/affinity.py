"""Session affinity: a session's next turn prefers the node that served its last one.

That node holds the conversation's KV. The residency index knows it too once the node's KV
events arrive; affinity covers the time they do not (events late, lost or disabled, predictions
expired after ``prediction_ttl_s`` while the user was typing). It works through the cost model,
not around it: the session's node is believed to *predict* the session's last prompt
(``Match.predicted`` raised to those blocks, capped by this prompt's: :meth:`View.residency`),
so a node that really holds more still wins and the hot-spot guard still ranks an overloaded
sticky node last.

The table maps a keyed hash of the session (:mod:`pdproxy.routing.session`; the key is random per
process, so ids cannot be chosen to collide) to the node and the session's prompt blocks, with a
TTL (``ttl_s``, refreshed by each turn) and a cap (``max_sessions``, least recently used evicted
first). It lives in each proxy process (shared state is not used): with several replicas, or
``--workers`` processes, a session sticks per process, and a session's turns that reach another
one route by the index alone. Threat model: a client sending many session ids evicts older
entries (counted), which costs other sessions their stickiness (a preference), never a wrong or
blocked answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.base import RequestOutcome
from pdproxy.routing.kv.plan import PromptShape
from pdproxy.routing.kv.scorers.base import Ask, Made, Over, Scorer, View
from pdproxy.settings.routing import KvRouterSettings
from pdproxy.settings.scorers import AffinitySettings


@dataclass(frozen=True, slots=True)
class _Entry:
    node: str
    blocks: int
    expires: float


class SessionAffinity:
    """The session table of one router (one model) in this replica."""

    def __init__(
        self,
        settings: AffinitySettings,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._key = os.urandom(16)
        self._table: OrderedDict[bytes, _Entry] = OrderedDict()
        self.outcomes = Counter(
            "pdproxy_kv_router_session_affinity",
            "Requests with a session, by what affinity did: sticky (the session's node was "
            "chosen), moved (another node won: more cached, or the hot-spot guard), new (no "
            "entry, or it expired), evicted (an entry dropped for the table cap)",
            ["outcome"],
            registry=registry,
        )

    def __len__(self) -> int:
        return len(self._table)

    def _slot(self, session: str) -> bytes:
        return hashlib.blake2b(session.encode(), key=self._key, digest_size=16).digest()

    def sticky_node(self, session: str | None) -> tuple[str, int] | None:
        """The session's node and its last prompt's blocks, if known and not expired."""
        if session is None or not self._settings.enabled:
            return None
        slot = self._slot(session)
        entry = self._table.get(slot)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            del self._table[slot]
            return None
        return entry.node, entry.blocks

    def chosen(self, sticky: tuple[str, int] | None, first: str) -> None:
        """Count what the decision did with a session's entry."""
        if sticky is None:
            self.outcomes.labels("new").inc()
        else:
            self.outcomes.labels("sticky" if sticky[0] == first else "moved").inc()

    def remember(self, session: str | None, node: str, blocks: int) -> None:
        """The session's turn was served by ``node`` (its prompt had ``blocks`` blocks)."""
        if session is None or not self._settings.enabled:
            return
        slot = self._slot(session)
        self._table[slot] = _Entry(node, blocks, self._clock() + self._settings.ttl_s)
        self._table.move_to_end(slot)
        while len(self._table) > self._settings.max_sessions:
            self._table.popitem(last=False)
            self.outcomes.labels("evicted").inc()


def boost(
    sticky: tuple[str, int] | None, matches: Mapping[NodeId, Match], prompt_blocks: int
) -> dict[NodeId, Match]:
    """``matches`` with the sticky node believed to predict the session's prefix."""
    out = dict(matches)
    if sticky is None:
        return out
    node = NodeId(sticky[0])
    blocks = min(sticky[1], prompt_blocks)
    held = out.get(node, Match())
    if blocks > held.predicted:
        out[node] = dataclasses.replace(held, predicted=blocks)
    return out


@dataclass(frozen=True, slots=True)
class AffinityView(View):
    sticky: tuple[str, int] | None
    """The session's node and its last prompt's blocks (None: no session, or no entry)."""

    def residency(
        self, matches: Mapping[NodeId, Match], prompt: PromptShape
    ) -> Mapping[NodeId, Match]:
        if self.sticky is None:
            return matches
        return boost(self.sticky, matches, prompt.blocks)


class AffinityScorer(Scorer[AffinityView]):
    name = "affinity"

    def __init__(self, sessions: SessionAffinity) -> None:
        self.sessions = sessions

    def observe(self, ask: Ask) -> AffinityView:
        return AffinityView(self.sessions.sticky_node(ask.request.session))

    def record(self, made: Made, view: AffinityView) -> None:
        if made.request.session is not None:
            self.sessions.chosen(view.sticky, made.plan.consumers[0])

    def finished(self, over: Over, outcome: RequestOutcome) -> None:
        if outcome.ok and outcome.consumer is not None:
            self.sessions.remember(over.session, outcome.consumer, over.blocks)


def build(settings: KvRouterSettings, registry: CollectorRegistry) -> AffinityScorer:
    return AffinityScorer(SessionAffinity(settings.affinity, registry))
