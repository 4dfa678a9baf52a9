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
        self._text += piece
        return self._advance(final=False)

    def finish(self) -> str:
        """Release everything still held (the request ended for another reason); a stop string
        whose match waited on a longer, earlier candidate is applied here."""
        if self.matched is not None:
            return ""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        # No stop string can start inside released text (the last ``_hold`` characters are
        # always held), so searching from ``_released`` finds every match still possible.
        best, found = -1, None
        for stop in self._stop:
            idx = self._text.find(stop, self._released)
            if idx != -1 and (best == -1 or idx < best):
                best, found = idx, stop
        end = len(self._text) if best == -1 else best
        pending = -1 if final else self._earliest_partial(end)
        if pending != -1:
            # A stop string that starts earlier than any full match may still complete: the
            # result must not depend on how the text was split into pieces.
            return self._release(min(pending, max(self._released, len(self._text) - self._hold)))
        if best != -1:
            self.matched = found
            self._text = self._text[:best]
            return self._release(best)
        return self._release(len(self._text) if final else len(self._text) - self._hold)

    def _earliest_partial(self, before: int) -> int:
        """The first position < ``before`` where the text so far is a proper prefix of a stop
        string (it could still become a match), or -1."""
        text = self._text
        for pos in range(max(self._released, len(text) - self._hold), before):
            tail = text[pos:]
            if any(len(stop) > len(tail) and stop.startswith(tail) for stop in self._stop):
                return pos
        return -1

    def _release(self, upto: int) -> str:
        if upto <= self._released:  # also keeps a negative ``upto`` from slicing from the end
            return ""
        out = self._text[self._released : upto]
        self._released = upto
        return out
