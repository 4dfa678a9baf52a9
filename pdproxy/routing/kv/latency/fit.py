"""A line ``y = intercept + slope x x`` learned online from observations, older ones decaying.

Each observation weighs ``1/e`` after ``window`` newer ones (exponential forgetting), so a node
whose speed changes is followed within a window. Until the first observation the line is the
seed; the seed's fixed part stays as an anchor of weight ``anchor`` (see ``__init__``).
Bounded: ``y`` is clipped to ``[0, max_y]``, ``x`` to ``>= 0``, non-finite values are
dropped; the slope stays within ``[SLOPE_FLOOR, SLOPE_CEILING]`` and the intercept within
``[0, max_intercept]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SLOPE_FLOOR = 1e-6
"""Milliseconds per unit of work at least (a node is never free)."""
SLOPE_CEILING = 1e4
_SPREAD = 1e-3
"""Least relative spread of the work below which the slope is fitted through the intercept."""
_Y_FLOOR = 5.0
"""Milliseconds: shorter legs weigh as much as this one (timer noise dominates them)."""


@dataclass(frozen=True, slots=True)
class Line:
    """A learned line, as one decision reads it."""

    intercept: float
    slope: float
    samples: int
    """Real observations folded in (the prior is not counted)."""

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


class DecayedFit:
    """Weighted least squares over decayed sums; :attr:`line` is recomputed on each change."""

    __slots__ = ("_anchor", "_decay", "_max_intercept", "_max_y", "_scale", "_sums", "line")

    def __init__(
        self,
        seed: Line,
        *,
        window: float,
        max_y: float,
        max_intercept: float = math.inf,
        anchor: float = 1.0,
    ) -> None:
        self._decay = math.exp(-1.0 / window)
        self._max_y = max_y
        self._max_intercept = max(max_intercept, seed.intercept)
        self._sums = [0.0, 0.0, 0.0, 0.0, 0.0]  # w, wx, wy, wxx, wxy of real observations
        # The seed's fixed part, as an observation at no work that never decays: with a few
        # observations of alike work (or a node whose speed just changed) the line still goes
        # through about the right start, and the slope carries the speed. Spread-out work
        # outweighs it at once.
        self._anchor = [0.0, 0.0, 0.0, 0.0, 0.0]
        _add(self._anchor, 0.0, seed.intercept, anchor)
        self._scale = 0.0
        self.line = Line(seed.intercept, seed.slope, 0)

    @property
    def reach(self) -> float:
        """The work up to which the line is read as learned: twice the observed work's mean
        plus two deviations (0 before any observation). Beyond it the line extrapolates: a
        consumer that prefilled only short suffixes alone (~150 tokens) was predicted 22 ms for
        a 2,600-token prompt that took 212 ms."""
        w, wx, _, wxx, _ = self._sums
        if w <= 0.0:
            return 0.0
        mean = wx / w
        spread = math.sqrt(max(wxx / w - mean * mean, 0.0))
        return 2.0 * (mean + 2.0 * spread)

    def observe(self, x: float, y: float) -> bool:
        """Fold one observation in; False when it is not a number."""
        if not (math.isfinite(x) and math.isfinite(y)):
            return False
        x = max(x, 0.0)
        y = min(max(y, 0.0), self._max_y)
        d = self._decay
        self._sums = [v * d for v in self._sums]
        # Relative errors are what a prediction is judged by (a 30 ms leg predicted 110 ms is
        # worse than a 1 s leg predicted 1.08 s), so each observation weighs 1/(y x y^), y^
        # the line's own prediction at x, scaled so that an average one weighs 1 (what the
        # anchor's weight is measured against). Not 1/y^2: that favours the legs that came
        # out fast (one that waited 250 ms behind work the backlog did not see weighed 1/25 of
        # a 50 ms one at the same work), so the line learned a node's best case, its backlog
        # drained too fast, and a node under a burst looked idle. Not 1/(y^ x y^) either (no
        # bias at one work, but a line that over-predicts comes down only as fast as it forgets):
        # the product weighs a leg 5x slower and one 5x faster than the line alike.
        raw = 1.0 / (max(self.line.at(x), _Y_FLOOR) * max(y, _Y_FLOOR))
        # The scale follows the observed times, so a line far below them (a seed, or a node
        # that slowed down) weighs its observations above the anchor until it has caught up.
        seen = 1.0 / max(y, _Y_FLOOR) ** 2
        self._scale = seen if self._scale == 0.0 else d * self._scale + (1.0 - d) * seen
        _add(self._sums, x, y, raw / self._scale)
        sums = [a + b for a, b in zip(self._sums, self._anchor, strict=True)]
        self.line = self._solve(sums, self.line.samples + 1)
        return True

    def _solve(self, sums: list[float], samples: int) -> Line:
        w, wx, wy, wxx, wxy = sums
        det = w * wxx - wx * wx
        if det > _SPREAD * max(w * wxx, 1.0):
            slope = (w * wxy - wx * wy) / det
        else:  # all the work alike: keep the intercept, fit the slope through it
            slope = (wy - self.line.intercept * w) / wx if wx > 0 else self.line.slope
        slope = min(max(slope, SLOPE_FLOOR), SLOPE_CEILING)
        intercept = (wy - slope * wx) / w
        if intercept < 0.0 or intercept > self._max_intercept:
            # The best line through the bound instead: a queue the backlog did not see makes
            # the times noisy, and noise must not turn "slow per token" into "slow to start".
            intercept = min(max(intercept, 0.0), self._max_intercept)
            if wxx > 0:
                slope = min(max((wxy - intercept * wx) / wxx, SLOPE_FLOOR), SLOPE_CEILING)
        return Line(intercept, slope, samples)


def _add(sums: list[float], x: float, y: float, w: float) -> None:
    sums[0] += w
    sums[1] += w * x
    sums[2] += w * y
    sums[3] += w * x * x
    sums[4] += w * x * y
