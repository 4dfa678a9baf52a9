"""``remote_kv_source`` on the scheduler side: ask a holder which of a request's blocks it holds.

A request with ``{"remote_kv_source": {"remote_host": H, "remote_port": P, "remote_engine_id":
E}}`` (E optional: the holder's node id) pulls what another node already holds instead of being
handed a producer's supply. The scheduler side sends the holder an ``offer`` of the prompt's
block keys; the holder pins the leading run it holds in its host pool under a fresh
``kv_request_id`` K2 (a short lease) and answers ``(K2, num_held)``. The scheduler then reports
the held blocks past its own prefix-cache hit to vLLM as an asynchronous load, and the worker
side fetches them under K2 exactly as it fetches a producer's supply (and sends ``done``).

vLLM's ``get_num_new_matched_tokens`` must answer at once, so the round trip cannot run there.
:class:`OfferDesk` starts it on the scheduler process's network thread and answers ``None`` ("not
known yet") until it ends; the connector returns ``(None, False)`` meanwhile, which vLLM 0.32's
scheduler treats as "skip this request this step, ask again next step" (it keeps stepping while
any request waits, see ``EngineCore._process_engine_step``).

Threads:

- the **scheduler thread** (vLLM's, in the engine-core process) calls :meth:`OfferDesk.ask`,
  :meth:`OfferDesk.claim`, :meth:`OfferDesk.drop` and :meth:`OfferDesk.close`; it polls
  futures and never waits on them. Only this thread touches the desk's rounds.
- the **network thread** (:class:`kvtier.vllm.loop.NetworkThread`) runs the offers and the
  releases of supplies nobody will fetch (a round dropped while its offer was in flight releases
  its K2 when the answer comes, from the offer's done-callback on that thread).

Threat model (who may send ``remote_kv_source``, what it can make this engine do): whoever can
send requests to vLLM's API (vLLM passes ``kv_transfer_params`` through from the client). It
can make the scheduler process open a TCP connection to a holder and start a P2P handshake,
bounded by ``offer_timeout_s`` per request (the request waits that long at most, then computes
its prompt) — only to holders in ``kv_source_allowed_peers`` (default loopback), so it cannot
aim the engine at arbitrary internal services. A holder that is not a secret holder fails the
handshake; one that is could already forge pages as any producer can (every page is verified
under the holder's page key, I6). Keep ``kv_transfer_params`` from untrusted clients out anyway
(a proxy in front sets them).

This module imports no vLLM (its unit tests run without it).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvtier.keys import OffloadKey
from kvtier.p2p.sink import AlreadyHeld, PageReservation
from kvtier.worker.kv_params import KvSource

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Offer:
    """A holder's answer: ``num_held`` leading keys pinned under ``kv_request_id`` (None when
    it pinned nothing: it holds none of them, refused, or could not be reached — ``reason``).
    Whoever owns an answer with a ``kv_request_id`` fetches it (``done``) or releases it."""

    kv_request_id: str | None
    num_held: int
    reason: str | None = None


class OfferAnswer(Protocol):
    """What :meth:`OfferClient.offer` returns (``kvtier.p2p.client.OfferResult``)."""

    @property
    def kv_request_id(self) -> str | None: ...

    @property
    def num_held(self) -> int: ...

    @property
    def reason(self) -> str | None: ...


class OfferClient(Protocol):
    """The part of :class:`kvtier.p2p.client.P2PClient` the desk uses. Neither call raises for
    transport failures; both return by ``deadline`` (a ``time.monotonic()`` value)."""

    async def offer(
        self,
        remote_host: str,
        remote_port: int,
        keys: Sequence[OffloadKey],
        *,
        expected_node_id: str | None = None,
        deadline: float | None = None,
    ) -> OfferAnswer: ...

    async def release(
        self,
        remote_host: str,
        remote_port: int,
        kv_request_id: str,
        deadline: float | None = None,
        *,
        expected_node_id: str | None = None,
    ) -> bool: ...


class Submitter(Protocol):
    """Runs coroutines on another thread's loop (:class:`kvtier.vllm.loop.NetworkThread`)."""

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]: ...


@dataclass(slots=True)
class _Round:
    source: KvSource
    future: concurrent.futures.Future[OfferAnswer]


class OfferDesk:
    """Offers in flight or answered, one per request (see the module docstring for threads).

    A round's K2 is owned by the desk until :meth:`claim` hands it to the caller (who then
    fetches it or releases it); :meth:`drop` and :meth:`close` release what was never claimed,
    so every pinned supply is released in exactly one place, or fetched (``done``)."""

    def __init__(
        self,
        client: OfferClient,
        net: Submitter,
        *,
        offer_timeout_s: float,
        release_timeout_s: float,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._on_close = on_close
        self._client = client
        self._net = net
        self._offer_timeout_s = offer_timeout_s
        self._release_timeout_s = release_timeout_s
        self._rounds: dict[str, _Round] = {}
        self._background: set[concurrent.futures.Future[bool]] = set()
        self._background_lock = threading.Lock()

    def ask(self, req_id: str, source: KvSource, keys: Sequence[OffloadKey]) -> Offer | None:
        """The holder's answer for ``req_id``, or None while it is not known yet (the first
        call starts the offer). Returns at once."""
        round_ = self._rounds.get(req_id)
        if round_ is None:
            deadline = time.monotonic() + self._offer_timeout_s
            future = self._net.submit(
                self._client.offer(
                    source.remote_host,
                    source.remote_port,
                    tuple(keys),
                    expected_node_id=source.remote_engine_id,
                    deadline=deadline,
                )
            )
            self._rounds[req_id] = _Round(source, future)
            return None
        if not round_.future.done():
            return None
        return _answer(round_.future)

    def claim(self, req_id: str) -> Offer | None:
        """Take an answered round out of the desk: its K2 (if any) is the caller's to fetch or
        release from now on. None when the round is unknown or still in flight."""
        round_ = self._rounds.get(req_id)
        if round_ is None or not round_.future.done():
            return None
        del self._rounds[req_id]
        return _answer(round_.future)

    def drop(self, req_id: str) -> None:
        """Forget ``req_id``'s round (the request finished or needs nothing): its supply, if the
        holder pinned one, is released now or as soon as the answer comes."""
        round_ = self._rounds.pop(req_id, None)
        if round_ is None:
            return
        source = round_.source

        def release_when_answered(future: concurrent.futures.Future[OfferAnswer]) -> None:
            offer = _answer(future)
            if offer.kv_request_id is not None:
                self.release(source, offer.kv_request_id)

        round_.future.add_done_callback(release_when_answered)

    def release(self, source: KvSource, kv_request_id: str) -> None:
        """Tell the holder to drop a pinned supply, on the network thread (any thread may
        call this; it returns at once)."""
        done = self._net.submit(
            self._client.release(
                source.remote_host,
                source.remote_port,
                kv_request_id,
                time.monotonic() + self._release_timeout_s,
                expected_node_id=source.remote_engine_id,
            )
        )
        with self._background_lock:
            self._background.add(done)
        done.add_done_callback(self._forget_background)

    def _forget_background(self, done: concurrent.futures.Future[bool]) -> None:
        with self._background_lock:
            self._background.discard(done)

    def in_flight(self) -> int:
        """Rounds not yet claimed or dropped, plus releases still running (a leak gauge)."""
        with self._background_lock:
            return len(self._rounds) + len(self._background)

    def close(self, timeout_s: float = 0.0) -> None:
        """Drop every round (shutdown), wait up to ``timeout_s`` for the releases that are
        running, then run ``on_close`` (stops the network thread the desk was given)."""
        for req_id in list(self._rounds):
            self.drop(req_id)
        with self._background_lock:
            running = list(self._background)
        concurrent.futures.wait(running, timeout=timeout_s)
        if self._on_close is not None:
            self._on_close()


def _answer(future: concurrent.futures.Future[OfferAnswer]) -> Offer:
    """A finished offer as an :class:`Offer`; a bug or cancellation becomes "nothing held"."""
    try:
        got = future.result(timeout=0)
    except concurrent.futures.CancelledError:
        return Offer(None, 0, "offer cancelled")
    except Exception as exc:  # a bug in the offer path: recompute, never crash the scheduler
        logger.exception("kvtier offer failed")
        return Offer(None, 0, f"offer failed: {exc!r}")
    if got.kv_request_id is None:
        return Offer(None, 0, got.reason or "the holder pinned nothing")
    # A K2 with nothing held is still a supply to release; keep it.
    return Offer(str(got.kv_request_id), max(int(got.num_held), 0), got.reason)


class NoPages:
    """The sink of the scheduler side's client, which only offers and releases: it holds no
    page and takes none (a block frame sent to it would end the exchange)."""

    def holds(self, key: OffloadKey) -> bool:
        return False

    def reserve(self, key: OffloadKey, nbytes: int) -> PageReservation | AlreadyHeld | None:
        return None

    def commit(self, reservations: Sequence[PageReservation]) -> None:
        if reservations:  # reserve never hands one out, so a commit of one is a client bug
            raise TypeError("NoPages made no reservation to commit")


def tokens_to_load(
    offer: Offer, *, num_computed_tokens: int, num_full_blocks: int, block_size: int
) -> int:
    """Tokens a held run adds past the local hit ``num_computed_tokens`` (0: nothing to load).

    The holder's run starts at the prompt's first block; only its full blocks that the prompt
    has (never more than ``num_full_blocks``) count, and only past what vLLM computed locally."""
    held = min(offer.num_held, num_full_blocks) if offer.kv_request_id is not None else 0
    return max(held * block_size - num_computed_tokens, 0)
