"""The scorer interface: one routing signal as the KV router calls it.

A signal is a :class:`Scorer` (the live half: its state, metrics and bookkeeping) that hands
each decision a :class:`View` (the pure half: a frozen snapshot of that state and the score
functions over it). Each scorer is one module of :mod:`pdproxy.routing.kv.scorers`, holding its
state, its factory ``build`` and its view; its settings are a section of ``router_options``
(:mod:`pdproxy.settings.scorers`), validated, field by field, when the config is loaded.

Who calls what, when. :class:`~pdproxy.routing.kv.router.KvRouter` calls every hook on its
event loop, in the order of the registry (:data:`pdproxy.routing.kv.scorers.SCORERS`); a
decision's hooks run in this order, and two decisions' hooks may interleave only at the
router's own awaits (the shared state's I/O), never inside a hook:

1. observe, :meth:`Scorer.observe`: once per decision, after the router read the residency
   index and the loads. Copies what scoring needs out of the scorer's live state into a
   frozen :class:`View`. It may tidy its own state (expire an entry); it may not do I/O.
2. score, the :class:`View`'s methods, called by :func:`pdproxy.routing.kv.decide.decide`:
   :meth:`View.residency` (what the decision believes each node holds),
   :meth:`View.credit` (how much of it the cost credits), :meth:`View.cost` (a term of a
   candidate's cost), and after the pick :meth:`View.revise` (rewrite the ranked plan). They
   are pure: the same view and arguments give the same answer, they read nothing live and
   change nothing, and the decision may call them any number of times.
3. record, :meth:`Scorer.record`: once, right after the decision, before the router writes
   its charges to the shared state: bookkeeping (counters, what is in flight).
4. :meth:`Scorer.annotate`: once, when the decision's explanation is built (rows per candidate).
5. :meth:`Scorer.finished`: once per decision when its request is over, before the router
   releases the decision's charges.

What a hook may not do: await, block, or do I/O (a scorer whose state comes from outside, KV
events or engine scrapes, is written by that I/O beside the router, see
:mod:`pdproxy.routing.kv.build`); raise (a bug there is a bug in routing; ``finished`` above
all must not); read another scorer's state (views meet only in the decision's sum).

Costs are in prefill-token equivalents, not scores in [0, 1]: a candidate's cost is the sum of
the views' terms, each already weighted by the scorer's settings (``weights``,
``engine_load.waiting_request_tokens``...), and the picker ranks cheapest first. A sum of
estimates in one unit keeps the relative weight of two signals the same for every request;
normalising each term to [0, 1] would need either per-request bounds (a missed 10-token prompt
would weigh as much as eight queued requests) or fixed caps (clipping changes picks at the cap).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry

from kvtier.residency.types import Match, NodeId
from pdproxy.routing.base import BackendView, RequestOutcome, RouteRequest
from pdproxy.routing.kv.plan import NodeState, Plan, PromptShape, Score, Task, Term
from pdproxy.settings.routing import KvRouterSettings


@dataclass(frozen=True, slots=True)
class Ask:
    """What a scorer may look at when it observes a decision."""

    request: RouteRequest
    candidates: Sequence[BackendView]
    """The producers, then the consumers, as the router was given them."""
    now: float
    """The decision's monotonic time (the same for every hook of the decision)."""


@dataclass(frozen=True, slots=True)
class Made:
    """A decision as :meth:`Scorer.record` sees it."""

    request: RouteRequest
    plan: Plan
    prompt: PromptShape | None
    """None: the decision routed by load alone (unhashable prompt, index unavailable)."""
    matches: Mapping[NodeId, Match]
    """What the decision believed each node holds (after the views' ``residency``)."""
    now: float


@dataclass(frozen=True, slots=True)
class Over:
    """A decision whose request is over, as :meth:`Scorer.finished` sees it."""

    request_id: str
    session: str | None
    blocks: int
    """Full blocks of the prompt the decision hashed (0: none)."""


class Costing(Protocol):
    """The candidates of one decision and their costs, as :meth:`View.revise` reads them."""

    @property
    def prompt(self) -> PromptShape | None: ...

    @property
    def producers(self) -> Sequence[NodeState]: ...

    @property
    def consumers(self) -> Sequence[NodeState]: ...

    def score(self, node: NodeState, task: Task) -> Score:
        """``node``'s cost for ``task``: every view's term, summed."""
        ...


class View:
    """A scorer's snapshot for one decision, and its pure score functions. Every method has a
    neutral default: a view overrides the ones its signal needs."""

    __slots__ = ()

    hooks: ClassVar[frozenset[str]] = frozenset()
    """The methods this class overrides (set for each subclass): the decision calls only
    those, the others being the neutral defaults."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.hooks = frozenset(
            m
            for m in ("residency", "credit", "cost", "revise")
            if getattr(cls, m) is not getattr(View, m)
        )

    def residency(
        self, matches: Mapping[NodeId, Match], prompt: PromptShape
    ) -> Mapping[NodeId, Match]:
        """What the decision believes each node holds (charges and the explanation use it
        too); called only when the prompt was hashed and the index answered."""
        return matches

    def credit(self, node: str, match: Match) -> Match:
        """How much of ``node``'s residency the cost credits it with."""
        return match

    def cost(self, node: NodeState, task: Task, prompt: PromptShape) -> Term | None:
        """This signal's part of ``node``'s cost for ``task`` (``prompt`` has 0 tokens when
        the decision routes by load alone); None: no part."""
        return None

    def revise(self, plan: Plan, costing: Costing) -> Plan:
        """The ranked plan, rewritten when this signal knows a better one."""
        return plan


V = TypeVar("V", bound=View)


class Scorer(ABC, Generic[V]):
    """One routing signal (see the module's docstring for who calls what, when)."""

    name: ClassVar[str]
    """Its key in the registry (and, where it has a section of its own, in ``router_options``)."""

    @abstractmethod
    def observe(self, ask: Ask) -> V:
        """The snapshot this decision scores with. No I/O, no await."""

    def record(self, made: Made, view: V) -> None:
        """The decision is made (``view`` is what :meth:`observe` gave it)."""

    def annotate(self, explain: Mapping[str, Any], now: float) -> None:
        """Add this signal's figures to the explanation's candidate rows (in place)."""

    def finished(self, over: Over, outcome: RequestOutcome) -> None:
        """The decision's request is over. Must not raise."""


ScorerT = TypeVar("ScorerT", bound=Scorer[Any])

ScorerFactory = Callable[[KvRouterSettings, CollectorRegistry], Scorer[Any]]
"""``build(settings, metrics_registry)``: a scorer for one router (one model)."""


def using(views: Sequence[View], hook: str) -> tuple[View, ...]:
    """The ``views`` whose class overrides ``hook`` (the others' is the neutral default)."""
    return tuple([v for v in views if hook in v.hooks])


def overriding(scorers: Sequence[ScorerT], hook: str) -> tuple[ScorerT, ...]:
    """The ``scorers`` whose class overrides the hook ``hook`` of :class:`Scorer`."""
    default = getattr(Scorer, hook)
    return tuple([s for s in scorers if getattr(type(s), hook) is not default])


def rows(explain: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The explanation's candidate rows, consumers then producers (for :meth:`Scorer.annotate`)."""
    out: list[dict[str, Any]] = []
    for side in ("consumers", "producers"):
        side_rows = explain.get(side)
        if isinstance(side_rows, list):
            out.extend(side_rows)
    return out
