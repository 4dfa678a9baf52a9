"""The match walk of the Redis index, over values read in chunks (pure; no I/O).

Like :class:`~kvtier.residency.memory.MemoryIndex`, the walk keeps four running ANDs of integer
masks along the chain (GPU, CPU, any tier, any tier or predicted), with slot ``s`` at bit
``2*s``; a bit that leaves a running AND at block ``pos`` makes ``pos`` that slot's prefix length
in that tier. The first block sets the masks, so only slots holding or predicting it take part;
the walk stops at the first block where no slot still matches. A block whose values equal the
previous block's changes nothing and is skipped unparsed.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.residency.redis_layout import predicted_slots, residency_bits

_EVEN: dict[int, int] = {}


def _even(nbytes: int) -> int:
    """Bits 0, 2, 4, ... of an ``nbytes``-byte value."""
    mask = _EVEN.get(nbytes)
    if mask is None:
        mask = _EVEN[nbytes] = int.from_bytes(b"\x55" * nbytes, "little")
    return mask


class Walk:
    """State of one match across chunks: :meth:`feed` values until :attr:`alive` is False."""

    __slots__ = ("_acc", "_now", "_prev", "alive", "lengths", "pos")

    def __init__(self, now_ms: int) -> None:
        self._now = now_ms
        self._acc: list[int] | None = None
        """Running ANDs: gpu, cpu, any, seen (slot s at bit 2s); None before the first block."""
        self._prev: tuple[bytes | None, bytes | None] | None = None
        self.pos = 0
        self.alive = True
        self.lengths: dict[int, list[int]] = {}
        """Slot → [gpu, cpu, total, predicted] prefix lengths of slots that dropped out."""

    def feed(self, residency: Sequence[bytes | None], predictions: Sequence[bytes | None]) -> bool:
        """Walk the next blocks (``predictions`` empty when none may exist); True while some
        slot still matches after them."""
        if not self.alive:
            return False
        no_pred = not predictions
        now = self._now
        for k, rv in enumerate(residency):
            pv = None if no_pred else predictions[k]
            if (rv, pv) == self._prev:
                self.pos += 1
                continue
            self._prev = (rv, pv)
            bits = residency_bits(rv)
            even = _even(len(rv)) if rv else 0
            g = bits & even
            c = (bits >> 1) & even
            a = g | c
            s = a
            if pv:
                for slot in predicted_slots(pv, now):
                    s |= 1 << (2 * slot)
            acc = self._acc
            if acc is None:
                if not s:
                    self.alive = False
                    return False
                self._acc = [g, c, a, s]
                for slot in _slots(s):
                    self.lengths[slot] = [0, 0, 0, 0]
            else:
                for i, new in enumerate((g, c, a, s)):
                    old = acc[i]
                    kept = old & new
                    if kept != old:
                        self._drop(old & ~kept, i)
                        acc[i] = kept
                if not acc[3]:
                    self.alive = False
                    return False
            self.pos += 1
        return True

    def _drop(self, gone: int, tier: int) -> None:
        pos = self.pos
        for slot in _slots(gone):
            self.lengths[slot][tier] = pos

    def result(self) -> dict[int, tuple[int, int, int, int]]:
        """Slot → (gpu, cpu, total, predicted) for slots that matched at least one block."""
        acc = self._acc
        if acc is not None:
            for i in range(4):
                self._drop(acc[i], i)
                acc[i] = 0
        return {s: (g, c, t, p) for s, (g, c, t, p) in self.lengths.items() if p}


def _slots(bits: int) -> list[int]:
    """Slots of the set bits of a mask (bit 2s is slot s)."""
    out = []
    while bits:
        low = bits & -bits
        out.append((low.bit_length() - 1) >> 1)
        bits ^= low
    return out
