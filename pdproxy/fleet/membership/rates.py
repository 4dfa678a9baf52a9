"""Message rates of registrants: a token bucket per sender and one for all of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """A token bucket: ``rate`` tokens a second, at most ``rate`` (one second of burst)."""

    rate: float
    tokens: float
    at: float

    def take(self, now: float) -> bool:
        self.tokens = min(max(self.rate, 1.0), self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True
