"""Where a consumer installs fetched pages: the protocols :class:`~kvtier.p2p.client.P2PClient`
writes through (:class:`~kvtier.p2p.pool_pages.PoolSink` implements them over the host pool).

A page is reserved per incoming key, received into, then either committed with the other pages
of its verified batch (:meth:`BlockSink.commit`: one commit per batch, so a pool's write
listeners and stored events run once per batch, not once per page) or aborted on its own.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final, Protocol

from kvtier.keys import OffloadKey


class PageReservation(Protocol):
    """A host page reserved for one incoming key, not readable until committed."""

    @property
    def buffer(self) -> memoryview:
        """Writable, exactly the key's payload size (format 'B')."""
        ...

    def abort(self) -> None:
        """Give the page back; the key stays absent (no-op once committed or aborted)."""
        ...


class AlreadyHeld(enum.Enum):
    """:meth:`BlockSink.reserve`'s answer for a key that turned up locally after the fetch
    demanded it (another fetch installed it meanwhile, or a local store did): the client skips
    the incoming payload and counts the key as usable."""

    ALREADY_HELD = "already held"


ALREADY_HELD: Final = AlreadyHeld.ALREADY_HELD


class BlockSink(Protocol):
    """Where a consumer installs fetched pages (its primary host tier)."""

    def holds(self, key: OffloadKey) -> bool:
        """True when ``key`` is already present locally (readable or write in flight)."""
        ...

    def reserve(self, key: OffloadKey, nbytes: int) -> PageReservation | AlreadyHeld | None:
        """A page for ``key``; :data:`ALREADY_HELD` when ``key`` is present locally by now; or
        None when no page can be freed (the prefix ends there)."""
        ...

    def commit(self, reservations: Sequence[PageReservation]) -> None:
        """Their payloads are verified: install these pages (reserved by this sink, in arrival
        order) under their keys, all in one step; readable from now on. A reservation already
        committed or aborted is skipped."""
        ...
