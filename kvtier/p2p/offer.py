"""Symmetric pull (vLLM's ``remote_kv_source``): ask a holder which keys it has, then fetch them.

A node that lacks part of a request's prefix, and knows a HOLDER that has it, needs no producer
leg. On an authenticated session it sends ``offer {keys}`` (the keys it lacks, in chunk order);
the holder pins the *contiguous leading run* of them that it holds into a fresh supply under a
random ``kv_request_id`` K2 with a short lease (``offer_lease_s``) and answers ``offered
{kv_request_id: K2, num_held: n}`` (``n == 0``: nothing held, no supply opened, K2 is None).
The puller then fetches ``keys[:n]`` through the ordinary demand/fetch path under K2 and sends
``done``. Pinning, serving, lease and release are the :class:`~kvtier.p2p.supply.SupplyRegistry`'s,
exactly as for a producer leg's supply: one owner per page lifetime.

Holder side: :class:`OfferDesk` (one per :class:`~kvtier.p2p.server.P2PServer`, given a
:class:`Holdings`: where held pages come from). :class:`PoolHoldings` serves what the host pool
holds (READABLE pages; a page whose write is in flight ends the run); the reference worker's
holdings also cascade blocks it holds only on its device into host pages first
(``kvtier.worker.holder``). Puller side: :meth:`kvtier.p2p.client.P2PClient.offer` and
:meth:`~kvtier.p2p.client.P2PClient.pull` (offer + fetch + done under one deadline), built on
:func:`request_offer`.

Threat model (who may send ``offer``, what it can make the holder do)
---------------------------------------------------------------------

*Who.* Only a peer that completed the handshake (holds ``KVTIER_P2P_SECRET``, or is on
loopback when no secret is set): ``offer`` is a sealed frame, refused before authentication
like every non-handshake frame, so nothing is allocated for an unauthenticated peer. When the
puller names the holder's node id (``remote_engine_id``), the handshake refuses any other node.

*What it reveals.* An offer is a membership oracle: any holder of the secret learns which of the
keys it names this node holds (and, by fetching, their KV). Keys are chained hashes of prompts,
so a peer that can guess a prompt can test whether this node served it. This is the trust the
P2P secret already grants (a peer holding it can fetch any supply whose id it learns); offers
make it direct. One secret per trust domain; do not share it with tenants that must not see
each other's prompts.

*What it can make the holder do.* Pin host pages (and, on the reference worker, copy device
blocks into host pages) for the keys it names, for at most ``offer_lease_s``. Bounded: at most
``max_keys_per_offer`` keys per offer and ``max_open_offers_per_session`` supplies opened by
offers and not yet done/released/expired per session (one more of either closes the session
with a logged reason), and at most ``max_open_offers`` such supplies in all, whatever the
session (one more is answered ``num_held: 0`` and counted as refused). A supply opened by an
offer outlives the session that asked for it: it ends by ``done``/``release`` (from any
session: vLLM's scheduler offers on one connection, its worker fetches on another) or by the
lease. A flood of offers that are never fetched therefore pins at most ``max_open_offers *
max_keys_per_offer`` pages (and never more than the pool holds), each released by the lease at
the latest; reconnecting does not reset the global count. An offer
is answered only on an idle session (no fetch queued or being served: frames stay in order);
one that overlaps a fetch closes the session. Pinned pages cannot be evicted, so a peer can
make the holder's host pool refuse stores (counted) for up to a lease; it cannot make the
holder send anything a fetch could not.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvtier.errors import HandshakeRefused, P2PError, ProtocolError
from kvtier.keys import OffloadKey
from kvtier.p2p.channel import PeerClosed
from kvtier.p2p.frames import KvRequestId, Offer, Offered
from kvtier.p2p.sealing import PageTag
from kvtier.p2p.sessions import Peer, Session, SessionPool
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.supply import SupplyPage, SupplyRegistry

if TYPE_CHECKING:
    from kvtier.p2p.tier import P2PTier

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class OfferResult:
    """A holder's answer: ``num_held`` leading offered keys are pinned under ``kv_request_id``
    (None when nothing was pinned); ``reason`` says why the answer is short or absent."""

    kv_request_id: KvRequestId | None
    num_held: int
    reason: str | None
    holder_short: bool = False
    """The holder answered and holds fewer of the offered keys than asked (it lacks the tail):
    the normal case of a pull, not a failure."""


@dataclass(frozen=True, slots=True)
class HeldPage:
    """One held key's page, referenced for the desk (the registry takes the reference over)."""

    key: OffloadKey
    page: SupplyPage
    tag: PageTag | None = None


class Holdings(Protocol):
    """Where an offer finds the pages this node holds."""

    async def pin_leading(self, keys: Sequence[OffloadKey]) -> list[HeldPage]:
        """References on the pages of the contiguous leading run of ``keys`` held here, in
        order (stops at the first key not held). The caller owns every reference returned;
        when cancelled, it releases what it pinned."""
        ...


class PoolHoldings:
    """Holdings of a host pool: READABLE pages, with the P2P tier's cached tags."""

    def __init__(self, tier: P2PTier) -> None:
        self._tier = tier

    async def pin_leading(self, keys: Sequence[OffloadKey]) -> list[HeldPage]:
        held: list[HeldPage] = []
        for key in keys:
            pinned = self._tier.pin_readable(key)
            if pinned is None:
                break
            held.append(HeldPage(key, *pinned))
        return held


@dataclass(frozen=True, slots=True)
class OfferStats:
    offers_total: int
    """Offers answered (any ``num_held``)."""
    offered_keys_total: int
    """Keys pinned for offers (the sum of ``num_held``)."""
    refused_total: int
    """Offers that closed their session: too many keys, too many open, or mid-fetch."""


class OfferLedger:
    """Supplies opened by offers and not yet ended (by done, release or lease), for a cap.

    One per session (``max_open_offers_per_session``) and one per desk (``max_open_offers``).
    The ledger only counts: the registry owns each supply and ends it; a session's end does
    not, so a fetch on another connection still finds it.
    """

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: list[KvRequestId] = []

    def open_count(self, registry: SupplyRegistry) -> int:
        self._open = [k for k in self._open if registry.is_open(k)]
        return len(self._open)

    def add(self, kv_request_id: KvRequestId) -> None:
        self._open.append(kv_request_id)


class OfferDesk:
    """The holder side: answers ``offer`` frames from one registry's pages."""

    def __init__(self, settings: P2PSettings, registry: SupplyRegistry, holdings: Holdings) -> None:
        self._settings = settings
        self._registry = registry
        self._holdings = holdings
        self._offers = 0
        self._offered_keys = 0
        self._refused = 0
        self._all_open = OfferLedger()

    def stats(self) -> OfferStats:
        return OfferStats(self._offers, self._offered_keys, self._refused)

    def check(self, offer: Offer, ledger: OfferLedger, *, fetch_in_flight: bool) -> None:
        """ProtocolError (the session closes) for an offer the limits refuse."""
        cap = self._settings.max_keys_per_offer
        reason = None
        if len(offer.keys) > cap:
            reason = f"offer of {len(offer.keys)} keys exceeds max_keys_per_offer ({cap})"
        elif fetch_in_flight:
            reason = "offer while a fetch is in flight on the session"
        elif ledger.open_count(self._registry) >= self._settings.max_open_offers_per_session:
            reason = (
                "too many open offers on one session "
                f"(max_open_offers_per_session={self._settings.max_open_offers_per_session})"
            )
        if reason is not None:
            self._refused += 1
            raise ProtocolError(reason)

    async def answer(self, offer: Offer, ledger: OfferLedger) -> Offered:
        """Pin the leading run of ``offer.keys`` held here under a fresh K2 (see the module)."""
        if self._all_open.open_count(self._registry) >= self._settings.max_open_offers:
            # Across sessions: a peer that reconnects must not pin more. Polite (no close):
            # an honest puller recomputes; the holder is busy, not attacked, as far as it knows.
            self._refused += 1
            logger.debug("p2p offer refused: max_open_offers (%d)", self._settings.max_open_offers)
            return Offered(None, 0)
        async with asyncio.timeout(self._settings.demand_wait_s):
            held = await self._holdings.pin_leading(offer.keys)
        self._offers += 1
        if not held:
            return Offered(None, 0)
        rid = KvRequestId(secrets.token_hex(16))
        registry = self._registry
        registry.open(rid, lease_s=self._settings.offer_lease_s)
        supplied = 0
        for i, item in enumerate(held):
            # Each reference is handed to the registry (kept or released there) or released.
            if supplied == i and item.key == offer.keys[i]:
                supplied += registry.supply(rid, item.key, item.page, item.tag)
            else:
                item.page.release()
        if supplied == 0:
            registry.release(rid, "offer: nothing could be supplied")
            return Offered(None, 0)
        registry.finish(rid)  # nothing more comes: demand beyond the run fails at once
        ledger.add(rid)
        self._all_open.add(rid)
        self._offered_keys += supplied
        logger.debug("p2p offer: %d of %d keys pinned under %s", supplied, len(offer.keys), rid)
        return Offered(rid, supplied)


async def request_offer(
    sessions: SessionPool,
    peer: Peer,
    keys: tuple[OffloadKey, ...],
    *,
    expected_node_id: str | None,
    deadline: float,
    max_keys: int,
) -> OfferResult:
    """The puller side of one offer (never raises for transport failures)."""
    if len(keys) > max_keys:
        return OfferResult(
            None, 0, f"offer of {len(keys)} keys exceeds max_keys_per_offer ({max_keys})"
        )
    if not keys:
        return OfferResult(None, 0, None)
    session: Session | None = None
    clean = False
    reason: str | None = None
    answer: Offered | None = None
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
            session = await sessions.take(peer, expected_node_id)
            try:
                answer = await _offer_on(session, keys)
            except PeerClosed:
                if not session.reused:
                    raise
                # An idle session the holder closed meanwhile: one fresh attempt.
                session.channel.close()
                session = await sessions.connect(peer, expected_node_id)
                answer = await _offer_on(session, keys)
            clean = True
    except TimeoutError:
        reason = "deadline passed"
    except HandshakeRefused as exc:
        reason = f"handshake refused: {exc}"
    except (P2PError, OSError) as exc:
        reason = f"transport: {exc}"
    finally:
        if session is not None:
            if clean:
                sessions.give_back(peer, session)
            else:
                session.channel.close()  # an unanswered offer's supply ends by the holder's lease
    if answer is None:
        logger.info("p2p offer to %s:%d failed: %s", peer[0], peer[1], reason)
        return OfferResult(None, 0, reason)
    short = answer.num_held < len(keys)
    if short:
        reason = f"the holder holds {answer.num_held} of the {len(keys)} keys offered"
    return OfferResult(answer.kv_request_id, answer.num_held, reason, holder_short=short)


async def _offer_on(session: Session, keys: tuple[OffloadKey, ...]) -> Offered:
    channel = session.channel
    await channel.send_frame(Offer(keys))
    frame = await channel.read_frame()
    if frame is None:
        raise PeerClosed("holder closed the connection after an offer")
    if not isinstance(frame, Offered):
        raise ProtocolError(f"unexpected {type(frame).__name__} frame answering an offer")
    if frame.num_held > len(keys):
        raise ProtocolError(f"holder claims {frame.num_held} of {len(keys)} offered keys")
    return frame
