"""Rate limits of hostile senders: a token bucket, and one per key with a bounded table.

The one rate limiter of both packages: P2P handshake attempts per source address
(:mod:`kvtier.p2p.admission`) and registration messages per key and in all
(:mod:`pdproxy.fleet.membership.registration`). Single-threaded: the event loop that owns it
calls it; nothing here blocks or allocates beyond one bucket per key.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens a second, at most ``burst``; created full."""

    rate: float
    burst: float
    tokens: float
    at: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def refill(self, now: float) -> None:
        # A clock that steps back refills nothing (never a negative refill either).
        self.tokens = min(self.burst, self.tokens + max(now - self.at, 0.0) * self.rate)
        self.at = now

    def take(self, now: float) -> bool:
        """One token, if there is one now."""
        self.refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def give_back(self) -> None:
        """Return a token taken for something that proved legitimate (never past ``burst``)."""
        self.tokens = min(self.tokens + 1.0, self.burst)


class TokenBuckets:
    """A :class:`TokenBucket` per key (a source address, a client key). The table keeps the
    ``max_keys`` most recently seen keys: many keys cannot grow it, and a forgotten key starts
    again full, which costs no more than a new key does."""

    def __init__(
        self,
        rate: float,
        burst: float,
        *,
        max_keys: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = rate
        self._burst = burst
        self._max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str) -> bool:
        return self._bucket(key).take(self._clock())

    def give_back(self, key: str) -> None:
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.give_back()

    def forget(self, key: str) -> None:
        self._buckets.pop(key, None)

    def __len__(self) -> int:
        return len(self._buckets)

    def _bucket(self, key: str) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        bucket = self._buckets[key] = TokenBucket.full(self._rate, self._burst, self._clock())
        while len(self._buckets) > self._max_keys:
            self._buckets.popitem(last=False)
        return bucket
