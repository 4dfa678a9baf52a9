"""The match walk of the Redis index, over runs of values read in chunks (pure; no I/O).

Like :class:`~kvtier.residency.memory.MemoryIndex`, the walk keeps four running ANDs of integer
masks along the chain (GPU, CPU, any tier, any tier or predicted), with slot ``s`` at bit
``2*s``; a bit that leaves a running AND at block ``pos`` makes ``pos`` that slot's prefix length
in that tier. The first block sets the masks (limited to :meth:`Walk.keep`'s slots when given:
a decision's candidates), so only slots holding or predicting it take part; the walk stops at
the first block where no slot still matches. Consecutive blocks with equal values are one step
(``groupby``, compared in C), and so is a block that differs from the previous one only in
slots not kept: the walk's Python work follows the kept slots' changes along the chain, not the
chain's length or the number of nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby, repeat

from kvtier.residency.redis_layout import predicted_slots, residency_bits

_EVEN: dict[int, int] = {}


def _even(nbytes: int) -> int:
    """Bits 0, 2, 4, ... of an ``nbytes``-byte value."""
    mask = _EVEN.get(nbytes)
    if mask is None:
        mask = _EVEN[nbytes] = int.from_bytes(b"\x55" * nbytes, "little")
    return mask


class Walk:
    """State of one match across chunks: :meth:`feed` values until it returns False."""

    __slots__ = (
        "_acc", "_keep", "_keep2", "_last", "_now", "_pm", "_pv", "alive", "lengths", "pos",
    )  # fmt: skip

    def __init__(self, now_ms: int) -> None:
        self._now = now_ms
        self._keep = -1
        self._keep2 = -1
        """Both tier bits of the kept slots: a block equal to the previous one on these bits
        and on the kept slots' predictions changes nothing and is skipped after two ANDs."""
        self._last: tuple[int, int] | None = None
        self._pv: bytes | None = None
        self._pm = 0
        """The last prediction value parsed and its slots' mask."""
        self._acc: list[int] | None = None
        """Running ANDs: gpu, cpu, any, seen (slot s at bit 2s); None before the first block."""
        self.pos = 0
        self.alive = True
        self.lengths: dict[int, list[int]] = {}
        """Slot → [gpu, cpu, total, predicted] prefix lengths of slots that dropped out."""

    def _predicted(self, pv: bytes | None) -> int:
        """Slots (bit 2s) with a live prediction in ``pv``; neighbours mostly share one."""
        if not pv:
            return 0
        if pv != self._pv:
            mask = 0
            for slot in predicted_slots(pv, self._now):
                mask |= 1 << (2 * slot)
            self._pv, self._pm = pv, mask
        return self._pm

    @staticmethod
    def _masks(bits: int, width: int, predicted: int) -> tuple[int, int, int, int]:
        even = _even(width)
        g = bits & even
        c = (bits >> 1) & even
        a = g | c
        return g, c, a, a | predicted

    def first_slots(self, rv: bytes | None, pv: bytes | None) -> list[int]:
        """Slots holding or predicting a block of these values (the prompt's first)."""
        width = len(rv) if rv else 0
        return _slots(self._masks(residency_bits(rv), width, self._predicted(pv))[3])

    def keep(self, slots: Sequence[int]) -> None:
        """Walk these slots only (before the first :meth:`feed`)."""
        keep = 0
        for slot in slots:
            keep |= 1 << (2 * slot)
        self._keep = keep
        self._keep2 = keep | (keep << 1)

    def feed(self, residency: Sequence[bytes | None], predictions: Sequence[bytes | None]) -> bool:
        """Walk the next blocks' values; True while some slot still matches after them."""
        if not self.alive:
            return False
        pairs = zip(residency, predictions if any(predictions) else repeat(None), strict=False)
        for (rv, pv), run in groupby(pairs):  # equal neighbours: one step (C-level compare)
            count = len(list(run))
            bits = residency_bits(rv)
            predicted = self._predicted(pv)
            kept = (bits & self._keep2, predicted & self._keep)
            if kept == self._last:
                self.pos += count
                continue
            self._last = kept
            new = self._masks(bits, len(rv) if rv else 0, predicted)
            acc = self._acc
            if acc is None:
                keep = self._keep
                acc = self._acc = [m & keep for m in new]
                if not acc[3]:
                    self.alive = False
                    return False
                for slot in _slots(acc[3]):
                    self.lengths[slot] = [0, 0, 0, 0]
            else:
                for tier in range(4):
                    old = acc[tier]
                    kept_bits = old & new[tier]
                    if kept_bits != old:
                        self._drop(old & ~kept_bits, tier)
                        acc[tier] = kept_bits
                if not acc[3]:
                    self.alive = False
                    return False
            self.pos += count
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
    """Slots of the set bits of a mask (bit 2s is slot s). A few bits (a node or two leaving
    the walk): one ``bit_length`` each. Many: ``bin`` and ``str.find`` in C, a step per set
    bit (``bits & -bits`` would allocate an integer as wide as the mask each)."""
    if bits.bit_count() <= 8:
        out = []
        while bits:
            top = bits.bit_length() - 1
            out.append(top >> 1)
            bits ^= 1 << top
        return out
    text = bin(bits)[:1:-1]
    out = []
    find = text.find
    pos = find("1")
    while pos >= 0:
        out.append(pos >> 1)
        pos = find("1", pos + 1)
    return out
