"""Page tags cached per pool page write, so a page is MACed once, not once per fetch.

A producer's page is tagged under its registry's page key (:mod:`kvtier.p2p.sealing`) the first
time it is supplied after its write completed; every later supply of the same write (the same
prefix in a later producer leg: a *warm* producer) reuses the tag, and no fetch reads a page to
MAC it. Entries are keyed by pool slot: at most one per slot, so the cache is bounded by the
pool's page count.

Why a cached tag stays right: a READABLE page's bytes do not change (the pool never rewrites a
present key: a new write needs the key evicted first, and a referenced page is never evicted).
The pool's write listener drops a key's entry whenever a write of that key completes, before
the tiering manager's own listener cascades the key to this tier (the tier registers first: it
exists before the manager that holds it), so a page rewritten into the same slot is tagged
afresh. Were a stale tag ever sent, the consumer's verification would refuse the page and
recompute (a wasted transfer, never a wrong page).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier.keys import OffloadKey
from kvtier.p2p.sealing import PageTag


class PageTagCache:
    """Tags of readable pool pages, by slot; thread-safe."""

    __slots__ = ("_lock", "_slot_of", "_tags")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tags: dict[int, tuple[OffloadKey, PageTag]] = {}
        self._slot_of: dict[OffloadKey, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._tags)

    def tag_of(self, key: OffloadKey, slot: int, compute: Callable[[], PageTag]) -> PageTag:
        """``key``'s tag in ``slot`` (the caller holds a reference on that page), computed with
        ``compute`` (outside the lock) when none is cached."""
        with self._lock:
            cached = self._tags.get(slot)
        if cached is not None and cached[0] == key:
            return cached[1]
        tag = compute()
        with self._lock:
            previous = self._tags.get(slot)
            if previous is not None and previous[0] != key:
                self._slot_of.pop(previous[0], None)
            self._tags[slot] = (key, tag)
            self._slot_of[key] = slot
        return tag

    def on_write_done(self, keys: tuple[OffloadKey, ...], success: bool) -> None:
        """Pool write listener: a completed (or failed) write of a key voids its old tag."""
        with self._lock:
            for key in keys:
                slot = self._slot_of.pop(key, None)
                if slot is not None:
                    self._tags.pop(slot, None)
