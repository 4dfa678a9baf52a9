"""The contract between the request path and a router.

The request path (``pdproxy.request.path``) filters the candidates first (role, dialect, routable),
builds a :class:`RouteRequest`, asks the router for a :class:`RouteDecision` ranking exactly the
objects it was given, tries them in order (retries and failover walk down the lists), and calls
:meth:`Router.finished` exactly once per decision, whatever happened. A router keeps what a
decision charged under the request id, which the request path makes unique. Simple
routers (round-robin, least-loaded) and the KV-aware router implement the same protocol, so the
request path never changes when the router does.

What a route decision tells the request path about a symmetric pull.

The node that prefills (the first producer of a disaggregated pair, or the consumer alone)
is sent ``kv_transfer_params.remote_kv_source`` naming ``holder``'s P2P server: it asks the
holder which of the prompt's blocks it has, pulls them, and computes only the rest. The
address is the holder backend's configured ``kv_address`` (never anything a client sent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from pdproxy.errors import NoBackendAvailable
from pdproxy.settings.backends import Role

__all__ = [
    "BackendView",
    "NoBackendAvailable",
    "RequestOutcome",
    "Role",
    "RouteDecision",
    "RouteRequest",
    "Router",
]


class BackendView(Protocol):
    """What a router may read of a backend; the backend registry owns the object."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def role(self) -> Role: ...

    @property
    def routable(self) -> bool:
        """Healthy, breaker not open, not draining."""
        ...

    @property
    def in_flight(self) -> int:
        """Requests this proxy has in flight on the backend."""
        ...


B = TypeVar("B", bound=BackendView)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    """Unique per request in flight (the proxy's own id, never the client's)."""
    endpoint: str
    """``"completions"`` or ``"chat"``."""
    body: Mapping[str, Any]
    """The client's parsed JSON body; read-only for routers."""
    body_bytes: int = 0
    """Size of the raw body: a cheap bound on everything a chat template can render."""
    session: str | None = None
    """The client's session, scoped by its key (:func:`pdproxy.routing.session.session_of`),
    for session affinity; None: no session."""
    model: str | None = None
    """The model the proxy's catalog resolved ``body["model"]`` to (None: not resolved, e.g. a
    router called directly; a per-model router then reads the body)."""
    ttft_class: str | None = None
    """The TTFT class the caller's key names (``interactive``, ``batch``...; None: the
    router's default class)."""
    ttft_target_ms: float | None = None
    """A target a trusted caller set on this request (over its class's)."""


@dataclass(frozen=True, slots=True)
class RouteDecision(Generic[B]):
    request_id: str
    consumers: Sequence[B]
    """Ranked consumer candidates (objects given to ``route``); the first is the choice, the
    rest are failover targets."""
    producers: Sequence[B]
    """Ranked producer candidates; empty means send the request to the consumer alone."""
    reason: str = ""
    """Short human-readable why (e.g. ``"kv-prefix"``, ``"short-suffix"``, ``"round-robin"``)."""
    explain: Mapping[str, Any] = field(default_factory=dict)
    """Candidates' scores for the opt-in debug header and debug log."""
    predicted_cached_tokens: int | None = None
    """Tokens the router expects the chosen consumer to find cached (for drift telemetry)."""
    predicted_producer_cached_tokens: int | None = None
    """Tokens the router expects the first producer to find cached (None: no producer leg, or
    no prediction)."""
    prompt_tokens: int | None = None
    route_time_s: float = 0.0
    consumer_ranks: Mapping[str, int] = field(default_factory=dict)
    """Data-parallel rank chosen on each consumer (by backend name); absent: the engine picks
    (:mod:`pdproxy.fleet.dp_ranks`)."""
    producer_ranks: Mapping[str, int] = field(default_factory=dict)
    """The same for producers (a backend may be producer on one rank, consumer on another)."""
    pull: PullSource | None = None
    """Symmetric pull: the node that prefills pulls the prefix from this holder (p2p only)."""


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What the request path reports back when a decision's request is over."""

    producer: str | None
    """Name of the producer that served the producer leg (None: none did)."""
    consumer: str | None
    ok: bool
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` from the consumer, when it reported one."""
    producer_cached_tokens: int | None = None
    """The same from the producer leg's answer (its own prefix-cache hit)."""
    # Timings are measurements, not what the request did: outcomes compare without them.
    producer_s: float = field(default=0.0, compare=False)
    """The producer phase's time (0: none ran); the TTFT model learns producer rates from it."""
    consumer_first_byte_s: float = field(default=0.0, compare=False)
    """From the consumer phase's start to its first byte (0: no answer): a stream's first
    token, a whole answer's end."""


class Router(Protocol):
    async def start(self) -> None:
        """Start background work (event subscriptions, refreshers)."""
        ...

    async def route(
        self,
        request: RouteRequest,
        producers: Sequence[B],
        consumers: Sequence[B],
    ) -> RouteDecision[B]:
        """Rank the candidates given (already filtered by role and dialect); the decision holds
        the same objects. Raises :class:`NoBackendAvailable` when none can serve."""
        ...

    async def finished(self, decision: RouteDecision[Any], outcome: RequestOutcome) -> None:
        """Called exactly once per decision; must not raise."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PullSource:
    holder: str
    """Backend name of the node holding the prefix."""
    host: str
    port: int
    engine_id: str | None
    """The holder's P2P node id (its handshake must prove it); None: not pinned."""
    blocks: int
    """Blocks the router expects the pull to move."""
