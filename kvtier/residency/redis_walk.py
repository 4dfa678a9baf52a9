"""The match walk of the Redis index, over values read in chunks (pure; no I/O).

Each slot still matching keeps four bits (GPU, CPU, any tier, any tier or predicted); a block
clears the bits the slot does not have there, and a bit cleared at block ``pos`` makes ``pos``
that tier's prefix length. The walk stops at the first block where no slot still matches. Only
slots holding or predicting the first block take part, so idle nodes cost nothing, and a block
whose values equal the previous block's changes nothing and is skipped unparsed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.residency.redis_layout import TIER_CPU, TIER_GPU, holders, predicted_slots

_GPU, _CPU, _ANY, _SEEN = 1, 2, 4, 8
_ALL = _GPU | _CPU | _ANY | _SEEN


class Walk:
    """State of one match across chunks: feed values with :meth:`feed` until it returns False."""

    __slots__ = ("_live", "_now", "_prev", "lengths", "pos")

    def __init__(self, now_ms: int) -> None:
        self._now = now_ms
        self._live: dict[int, int] | None = None
        """Slot → bits still matching; None before the first block."""
        self._prev: tuple[bytes | None, bytes | None] | None = None
        self.pos = 0
        self.lengths: dict[int, list[int]] = {}
        """Slot → [gpu, cpu, total, predicted] prefix lengths found so far."""

    @property
    def alive(self) -> bool:
        return self._live is None or bool(self._live)

    @property
    def slots(self) -> list[int]:
        """Slots that matched at least one block (so far)."""
        return list(self.lengths)

    def feed(self, residency: Sequence[bytes | None], predictions: Sequence[bytes | None]) -> bool:
        """Walk the next blocks (``predictions`` empty when none may exist); True while some
        slot still matches after them."""
        no_pred = not predictions
        for k, rv in enumerate(residency):
            pv = None if no_pred else predictions[k]
            if (rv, pv) == self._prev:
                self.pos += 1
                continue
            self._prev = (rv, pv)
            if not self._step(holders(rv), predicted_slots(pv, self._now)):
                self._finish()
                return False
            self.pos += 1
        return True

    def _step(self, held: dict[int, int], pred: set[int]) -> bool:
        live = self._live
        if live is None:
            live = self._live = {s: _ALL for s in (*held, *pred)}
            for s in live:
                self.lengths[s] = [0, 0, 0, 0]
        pos = self.pos
        for s, bits in list(live.items()):
            tiers = held.get(s, 0)
            have = _SEEN if tiers or s in pred else 0
            if tiers:
                have |= _ANY
                if tiers & TIER_GPU:
                    have |= _GPU
                if tiers & TIER_CPU:
                    have |= _CPU
            new = bits & have
            if new != bits:
                self._drop(s, bits & ~new, pos)
                if new:
                    live[s] = new
                else:
                    del live[s]
        return bool(live)

    def _drop(self, slot: int, gone: int, pos: int) -> None:
        row = self.lengths[slot]
        for i, bit in enumerate((_GPU, _CPU, _ANY, _SEEN)):
            if gone & bit:
                row[i] = pos

    def _finish(self) -> None:
        """Slots still matching at the end hold everything walked."""
        for s, bits in (self._live or {}).items():
            self._drop(s, bits, self.pos)
        if self._live:
            self._live.clear()

    def result(self) -> dict[int, tuple[int, int, int, int]]:
        """Slot → (gpu, cpu, total, predicted) for slots that matched at least one block."""
        self._finish()
        return {s: (g, c, t, p) for s, (g, c, t, p) in self.lengths.items() if p}
