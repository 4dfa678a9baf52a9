"""What the TTFT model has learned of each node: two lines and a backlog (state).

- ``compute``: a prefill leg's time, ``ms = leg + ms_per_token x work``, where ``work`` is the
  prefill tokens queued ahead of the request on the node plus its own uncached ones. Learned from
  producer legs, and from consumers serving streams alone (their first byte is their first
  token).
- ``fetch``: a PD consumer's time from its leg to its first token, ``ms = first_step +
  ms_per_block x blocks fetched``, its own prefill backlog aside. Learned from streamed PD
  consumer legs.
- the backlog: prefill tokens the router sent the node and believes not yet computed. Each
  decision adds its uncached tokens; it drains at the node's learned rate. With engine-load
  scraping on, the requests the engine reports waiting (at this router's mean prefill) floor
  it: work other proxies or processes sent. No completion
  callback is needed, and a wrong rate corrects itself: a node slower than believed drains
  slower in truth, its legs take longer than predicted, and its learned rate follows.

A node seen for the first time, or one with fewer than ``warm_samples`` observations of a line,
is read with the fastest line of the nodes that have them; with none, the configured seed. The
optimism is on purpose: a node is only learned by being sent work, and an unknown node read as
slow would never be (its first few legs pay for the lesson; a mediocre guess would cost every
request it could have served faster). For the same reason a learned line drifts toward the pool's
fastest while its node goes unobserved and others do not (weight ``1 - exp(-age / relearn_s)``,
``age`` since its last observation up to the pool's last): a node that was
slow is tried again now and then, and one that got faster is found. Nodes are bounded by
``max_nodes`` (the least recently used is forgotten).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from pdproxy.routing.kv.latency.fit import DecayedFit, Line
from pdproxy.settings.scorers import TtftSettings

_TYPICAL_WORK = 1024.0
"""Tokens (or blocks) at which two lines are compared to pick the fastest."""
_MEAN_ALPHA = 0.05
_INITIAL_ERROR = 1.0
"""Predictions count as off by 2x until some were checked."""


@dataclass(frozen=True, slots=True)
class NodeRate:
    """One node as a decision reads it."""

    compute: Line
    fetch: Line
    backlog_tokens: float
    learned: bool
    """Its own compute line is warm (else it is read with the pool's or the seed)."""
    observed_at: float = 0.0
    """When a leg it prefilled was last observed (monotonic seconds; 0: never)."""
    fetch_learned: bool = False
    """Its fetch line was learned from observed PD consumer legs (its own, or the pool's)."""
    compute_reach: float = math.inf
    """Prefill work up to which the compute line it is read with (its own, or the pool's) was
    observed (:attr:`DecayedFit.reach`; 0: the seed)."""

    def drain_ms(self, tokens: float) -> float:
        return self.compute.slope * tokens


class NodeRates:
    """One node's lines and backlog (live state)."""

    __slots__ = ("_at", "_backlog", "_waiting", "compute", "fetch", "observed_at")

    def __init__(self, settings: TtftSettings) -> None:
        window, max_y = settings.window_samples, settings.max_leg_ms
        self.compute = DecayedFit(
            Line(settings.seed_leg_ms, settings.seed_prefill_ms_per_token, 0),
            window=window,
            max_y=max_y,
            max_intercept=settings.max_fixed_ms,
        )
        self.fetch = DecayedFit(
            Line(settings.seed_first_step_ms, settings.seed_fetch_ms_per_block, 0),
            window=window,
            max_y=max_y,
            max_intercept=settings.max_fixed_ms,
        )
        self._backlog = 0.0
        self._at = 0.0
        self._waiting = (0.0, 0.0)
        """The engine's last reported queue, in tokens, and when."""
        self.observed_at = 0.0

    def backlog(self, now: float, ms_per_token: float) -> float:
        """Prefill tokens still ahead at ``now`` (monotonic seconds), drained at the rate the
        decisions read the node with: this router's own, or what the engine last reported
        waiting when that is more (other proxies' or processes' work)."""
        own = _drained(self._backlog, self._at, now, ms_per_token)
        return max(own, _drained(*self._waiting, now, ms_per_token))

    def engine_waiting(self, tokens: float, at: float) -> None:
        self._waiting = (max(tokens, 0.0), at)

    def queue(self, tokens: float, now: float, ms_per_token: float) -> None:
        self._backlog = _drained(self._backlog, self._at, now, ms_per_token) + max(tokens, 0.0)
        self._at = now


def _drained(tokens: float, at: float, now: float, ms_per_token: float) -> float:
    if tokens <= 0.0:
        return 0.0
    return max(tokens - max(now - at, 0.0) * 1e3 / ms_per_token, 0.0)


@dataclass(frozen=True, slots=True)
class _PoolLine:
    line: Line
    reach: float


class PoolRates:
    """Every node's rates, for one router (one model). Written only by the TTFT scorer."""

    def __init__(self, settings: TtftSettings) -> None:
        self.settings = settings
        self._nodes: OrderedDict[str, NodeRates] = OrderedDict()
        self._pool_compute: Line | None = None
        self._pool_fetch: Line | None = None
        self._pool_reach = 0.0
        """The work up to which the pool's compute line was observed."""
        self._last_observed = 0.0
        """When any node's compute leg was last observed."""
        self._mean_tokens = _TYPICAL_WORK / 2
        """Mean uncached prefill tokens of this router's requests (an engine's waiting request
        is counted at this)."""
        self._log_error = math.log1p(_INITIAL_ERROR)
        self._errors = 0

    def node(self, name: str) -> NodeRates:
        rates = self._nodes.get(name)
        if rates is None:
            rates = self._nodes[name] = NodeRates(self.settings)
            while len(self._nodes) > self.settings.max_nodes:
                self._nodes.popitem(last=False)
        else:
            self._nodes.move_to_end(name)
        return rates

    @property
    def warm(self) -> bool:
        """Some node's compute line is learned: predictions are worth routing by."""
        return self._pool_compute is not None

    def observe_compute(self, name: str, work_tokens: float, ms: float, now: float) -> None:
        rates = self.node(name)
        rates.observed_at = now
        self._last_observed = max(self._last_observed, now)
        if rates.compute.observe(work_tokens, ms):
            fastest = self._fastest(r.compute for r in self._nodes.values())
            self._pool_compute = fastest.line if fastest is not None else None
            self._pool_reach = fastest.reach if fastest is not None else 0.0

    def observe_error(self, predicted_ms: float, observed_ms: float) -> None:
        """A warm prediction against what was observed (a prefill leg, or a stream's TTFT)."""
        if not (predicted_ms > 0.0 and observed_ms > 0.0):
            return
        miss = abs(math.log(predicted_ms / observed_ms))
        self._errors += 1
        alpha = max(1.0 / self._errors, 1.0 / self.settings.window_samples)
        self._log_error += alpha * (miss - self._log_error)

    @property
    def error_share(self) -> float:
        """How far off the recent warm predictions were, as a share (0.3: by a factor of 1.3
        either way, on the geometric mean); 1.0 before any was checked."""
        return math.expm1(self._log_error)

    def observe_fetch(self, name: str, blocks: float, ms: float) -> None:
        if self.node(name).fetch.observe(blocks, ms):
            fastest = self._fastest(r.fetch for r in self._nodes.values())
            self._pool_fetch = fastest.line if fastest is not None else None

    def _fastest(self, fits: Iterable[DecayedFit]) -> _PoolLine | None:
        """The warm line fastest at a typical prompt's work (None: no line is warm)."""
        warm = [f for f in fits if f.line.samples >= self.settings.warm_samples]
        if not warm:
            return None
        best = min(warm, key=lambda f: f.line.at(_TYPICAL_WORK))
        return _PoolLine(Line(best.line.intercept, best.line.slope, 0), best.reach)

    def _read(self, fit: DecayedFit, pool: Line | None) -> Line:
        if fit.line.samples >= self.settings.warm_samples or pool is None:
            return fit.line
        return pool

    def _compute(self, rates: NodeRates) -> Line:
        """A node's compute line as decisions read it: its own, drifting toward the pool's
        fastest while the node goes unobserved (``relearn_s``)."""
        line = self._read(rates.compute, self._pool_compute)
        pool = self._pool_compute
        if pool is None or line is pool or rates.observed_at <= 0.0:
            return line
        # Unobserved while others were: an idle pool drifts nowhere (a lull is not news).
        age = self._last_observed - rates.observed_at
        if age <= 0.0:
            return line
        a = 1.0 - math.exp(-age / self.settings.relearn_s)
        return Line(
            line.intercept + a * (pool.intercept - line.intercept),
            line.slope + a * (pool.slope - line.slope),
            line.samples,
        )

    def snapshot(self, names: Iterable[str], now: float) -> dict[str, NodeRate]:
        """Each named node as a decision reads it (a node not seen yet is created)."""
        out = {}
        for name in names:
            rates = self.node(name)
            compute = self._compute(rates)
            own = rates.compute.line.samples >= self.settings.warm_samples
            fetch_own = rates.fetch.line.samples >= self.settings.warm_samples
            out[name] = NodeRate(
                compute,
                self._read(rates.fetch, self._pool_fetch),
                rates.backlog(now, compute.slope),
                own,
                rates.observed_at,
                fetch_own or self._pool_fetch is not None,
                rates.compute.reach if own else self._pool_reach,
            )
        return out

    def engine_waiting(self, name: str, requests: int, at: float) -> None:
        """``name``'s engine reported ``requests`` waiting at ``at`` (the engine-load scrape):
        counted at the mean prefill of this router's requests, it floors the node's backlog."""
        self.node(name).engine_waiting(requests * self._mean_tokens, at)

    def queue(self, name: str, tokens: float, now: float) -> None:
        """``tokens`` of prefill sent to ``name`` now."""
        self._mean_tokens += _MEAN_ALPHA * (max(tokens, 0.0) - self._mean_tokens)
        rates = self.node(name)
        rates.queue(tokens, now, self._compute(rates).slope)

    def items(self) -> Iterator[tuple[str, NodeRates]]:
        return iter(list(self._nodes.items()))

    def exported(self, now: float) -> Mapping[str, NodeRate]:
        """Every node's rates (the metrics and the admin view)."""
        return self.snapshot(list(self._nodes), now)
