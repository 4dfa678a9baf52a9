"""Stop strings over streamed text: release text only once no stop string can still match it."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Accumulates decoded text; reports released text and whether a stop string matched.

    Text that could be the start of a stop string is held back until it cannot be, so a client
    never sees a partial stop string; on a match the stop string and anything after it is cut.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._text = ""
        self._released = 0
        self.matched: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self._released]

    def push(self, piece: str) -> str:
        """Add decoded text; returns the newly released text."""
        if self.matched is not None:
            return ""
        search_from = max(0, len(self._text) - self._hold)
        self._text += piece
        best = -1
        for s in self._stop:
            idx = self._text.find(s, search_from)
            if idx != -1 and (best == -1 or idx < best):
                best, self.matched = idx, s
        if best != -1:
            self._text = self._text[:best]
            return self._release(best)
        return self._release(max(self._released, len(self._text) - self._hold))

    def finish(self) -> str:
        """Release everything still held (the request ended for another reason)."""
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        out = self._text[self._released : upto]
        self._released = max(self._released, upto)
        return out
