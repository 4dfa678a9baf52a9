"""Consumer side: fetch the missing contiguous range of a producer's supply into host pages.

Use inside the worker's asyncio loop::

    client = P2PClient(settings, identity, sink)     # sink: where fetched pages are installed
    result = await client.fetch(remote_host, remote_port, kv_request_id, keys, deadline)
    result.usable        # leading keys of ``keys`` now held locally (local hits + fetched)
    result.fetched       # keys this fetch installed, in order
    result.reason        # why the usable prefix ends early (None when complete)
    await client.close()

``keys`` is the request's chunk keys in order. Leading keys the sink already holds are not
fetched, nor any later key it holds; the rest is demanded in one ``fetch`` frame. The producer
answers with ``blocks`` frames (a batch of pages each); every payload is received straight into
the page the sink reserved (``recvmsg_into`` across the batch's pages), its key checked against
the session-MACed header and its payload against the header's page tag, and only then
committed (I6): a page that fails is aborted, never readable (:mod:`kvtier.p2p.receive`).
Payload verification runs on one worker thread per client, overlapping the next receive, where
the process has spare cores, else on the loop as each page lands (``settings.verify_thread``);
each verified batch is committed in one step (:mod:`kvtier.p2p.installs`); the sink protocols
are in :mod:`kvtier.p2p.sink`. ``expected_node_id`` (the producer's node id from its
answer) makes the handshake refuse any other node. A key the sink holds by the time its block
comes (another fetch installed it meanwhile) has its payload skipped and counts as usable. A key
that fails, is refused by the sink (no page can be freed), or misses ``deadline`` ends the
usable prefix there; fetch never raises for transport failures, it returns what is usable and
why the rest is not, within ``deadline`` (a ``time.monotonic()`` value; default ``now +
settings.fetch_timeout_s``). After the fetch the client sends ``done`` so the producer releases
the supply (``finish=False`` keeps it for a later fetch).

Sessions are reused per producer (one fetch at a time per connection; several connections per
producer when fetches run concurrently, at most ``max_sessions_per_peer`` kept idle).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import HandshakeRefused, IntegrityError, P2PError
from kvtier.keys import OffloadKey
from kvtier.p2p.channel import PeerClosed
from kvtier.p2p.frames import (
    MAX_ID_CHARS,
    Done,
    Fetch,
    KvRequestId,
    Release,
    as_keys,
)
from kvtier.p2p.handshake import LocalIdentity
from kvtier.p2p.offer import OfferResult, request_offer
from kvtier.p2p.receive import BlockReceiver, FetchProgress
from kvtier.p2p.sessions import Session, SessionPool
from kvtier.p2p.settings import P2PSettings
from kvtier.p2p.sink import ALREADY_HELD, AlreadyHeld, BlockSink, PageReservation

__all__ = [
    "ALREADY_HELD",
    "AlreadyHeld",
    "BlockSink",
    "FetchResult",
    "OfferResult",
    "P2PClient",
    "PageReservation",
]

logger = logging.getLogger(__name__)


_VERIFY_THREAD_FROM_CPUS = 4
"""From this many usable CPUs a verify thread finds a core of its own (both ends of a fetch on
two shared cores measured faster verifying on the loop: :mod:`kvtier.p2p.installs`)."""


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What one fetch achieved. ``usable`` leading keys of ``keys`` are now held locally."""

    kv_request_id: KvRequestId
    keys: tuple[OffloadKey, ...]
    usable: int
    local: int
    """Keys of ``keys`` that were already held locally (not fetched)."""
    fetched: tuple[OffloadKey, ...]
    nbytes: int
    elapsed_s: float
    reason: str | None = None
    found_meanwhile: tuple[OffloadKey, ...] = ()
    """Demanded keys that were present locally by the time their block came (installed by
    another fetch or a local store): their payload was skipped, and they count as usable."""
    holder_short: bool = False
    """(A pull) short only because the holder held fewer keys than asked; all it pinned came."""

    @property
    def complete(self) -> bool:
        return self.usable == len(self.keys)


@dataclass(frozen=True, slots=True)
class _Producer:
    """Where a fetch goes, and which node it must find there (None: any that authenticates)."""

    host: str
    port: int
    node_id: str | None


class P2PClient:
    """Fetches supply from producers; one instance per consumer worker."""

    def __init__(self, settings: P2PSettings, identity: LocalIdentity, sink: BlockSink) -> None:
        self.settings = settings
        self.identity = identity
        self.sink = sink
        self._sessions = SessionPool(settings, identity)
        self._verifier: concurrent.futures.ThreadPoolExecutor | None = None
        verify_thread = settings.verify_thread
        if verify_thread is None:
            verify_thread = _usable_cpus() >= _VERIFY_THREAD_FROM_CPUS
        self._verify_thread = verify_thread

    async def fetch(
        self,
        remote_host: str,
        remote_port: int,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        deadline: float | None = None,
        *,
        finish: bool = True,
        expected_node_id: str | None = None,
    ) -> FetchResult:
        """Fetch the keys of ``keys`` that the sink lacks; see the module docstring.

        ``expected_node_id``: the producer's node id (from its answer); the handshake refuses
        any other node. Required when ``settings.require_producer_id`` is set.
        """
        rid = _checked_id(kv_request_id)
        wanted = as_keys(keys)
        started = time.monotonic()
        if deadline is None:
            deadline = started + self.settings.fetch_timeout_s
        held = [self.sink.holds(k) for k in wanted]
        missing = tuple(dict.fromkeys(k for k, h in zip(wanted, held, strict=True) if not h))
        progress = FetchProgress()
        if expected_node_id is None and self.settings.require_producer_id:
            progress.reason = "the producer's node id is unknown; it is required"
        elif missing or finish:
            await self._exchange(
                _Producer(remote_host, remote_port, expected_node_id),
                rid,
                missing=missing,
                deadline=deadline,
                finish=finish,
                progress=progress,
            )
        got = {*progress.fetched, *progress.found_meanwhile}
        usable = 0
        for key, was_held in zip(wanted, held, strict=True):
            if not (was_held or key in got):
                break
            usable += 1
        return FetchResult(
            rid,
            wanted,
            usable,
            sum(held),
            tuple(progress.fetched),
            progress.nbytes,
            time.monotonic() - started,
            progress.reason if usable < len(wanted) else None,
            tuple(progress.found_meanwhile),
        )

    async def release(
        self,
        remote_host: str,
        remote_port: int,
        kv_request_id: str,
        deadline: float | None = None,
        *,
        expected_node_id: str | None = None,
    ) -> bool:
        """Ask a producer to release ``kv_request_id`` (e.g. the client went away)."""
        rid = _checked_id(kv_request_id)
        if deadline is None:
            deadline = time.monotonic() + self.settings.connect_timeout_s
        session: Session | None = None
        sent = False
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                peer = (remote_host, remote_port)
                session = await self._sessions.take(peer, expected_node_id)
                await session.channel.send_frame(Release(rid))
                sent = True
        except (P2PError, OSError, TimeoutError) as exc:
            logger.warning(
                "p2p release %s at %s:%d failed: %s", kv_request_id, remote_host, remote_port, exc
            )
        finally:
            if session is not None:
                if sent:
                    self._sessions.give_back((remote_host, remote_port), session)
                else:
                    session.channel.close()
        return sent

    async def offer(
        self,
        remote_host: str,
        remote_port: int,
        keys: Sequence[OffloadKey],
        *,
        expected_node_id: str | None = None,
        deadline: float | None = None,
    ) -> OfferResult:
        """Ask a holder to pin the leading run of ``keys`` it holds (:mod:`kvtier.p2p.offer`).

        Never raises for transport failures: ``num_held`` 0 and a ``reason``. The pinned
        supply is fetched under the answer's ``kv_request_id`` (then ``done``), or left to its
        short lease.
        """
        if deadline is None:
            deadline = time.monotonic() + self.settings.fetch_timeout_s
        if expected_node_id is None and self.settings.require_producer_id:
            return OfferResult(None, 0, "the holder's node id is unknown; it is required")
        return await request_offer(
            self._sessions,
            (remote_host, remote_port),
            as_keys(keys),
            expected_node_id=expected_node_id,
            deadline=deadline,
            max_keys=self.settings.max_keys_per_offer,
        )

    async def pull(
        self,
        remote_host: str,
        remote_port: int,
        keys: Sequence[OffloadKey],
        *,
        expected_node_id: str | None = None,
        deadline: float | None = None,
    ) -> FetchResult:
        """Symmetric pull: offer the keys of ``keys`` the sink lacks to a holder, fetch the run
        it holds, then ``done`` — all within ``deadline``. The result reads like
        :meth:`fetch`'s over ``keys`` (``kv_request_id`` is the holder's K2, or empty when it
        held none of them). Never raises for transport failures.
        """
        started = time.monotonic()
        if deadline is None:
            deadline = started + self.settings.fetch_timeout_s
        wanted = as_keys(keys)
        held = [self.sink.holds(k) for k in wanted]
        missing = tuple(dict.fromkeys(k for k, h in zip(wanted, held, strict=True) if not h))
        cap = self.settings.max_keys_per_offer
        offered = await self.offer(
            remote_host,
            remote_port,
            missing[:cap],
            expected_node_id=expected_node_id,
            deadline=deadline,
        )
        fetched: FetchResult | None = None
        if offered.kv_request_id is not None:
            fetched = await self.fetch(
                remote_host,
                remote_port,
                offered.kv_request_id,
                missing[: offered.num_held],
                deadline,
                expected_node_id=expected_node_id,
            )
        got = set() if fetched is None else {*fetched.fetched, *fetched.found_meanwhile}
        usable = 0
        for key, was_held in zip(wanted, held, strict=True):
            if not (was_held or key in got):
                break
            usable += 1
        reason = None
        fetch_reason = fetched.reason if fetched is not None else None
        holder_short = False
        if usable < len(wanted):
            reason = fetch_reason or offered.reason
            holder_short = fetch_reason is None and offered.holder_short
            if reason is None and len(missing) > cap:
                reason = f"offer capped at max_keys_per_offer ({cap}) keys"
        return FetchResult(
            offered.kv_request_id or KvRequestId(""),
            wanted,
            usable,
            sum(held),
            () if fetched is None else fetched.fetched,
            0 if fetched is None else fetched.nbytes,
            time.monotonic() - started,
            reason,
            () if fetched is None else fetched.found_meanwhile,
            holder_short,
        )

    @property
    def sessions_opened(self) -> int:
        """Connections opened so far (reuse keeps this low)."""
        return self._sessions.opened

    @property
    def verifies_on_thread(self) -> bool:
        """Whether fetched payloads are verified on a worker thread (else on the loop)."""
        return self._verify_thread

    async def close(self) -> None:
        """Close idle sessions and the verification thread; later fetches open new ones, and
        close them when done."""
        self._sessions.close()
        verifier, self._verifier = self._verifier, None
        if verifier is not None:
            verifier.shutdown(wait=False)  # a batch in flight finishes, then the thread ends

    def _receiver(self) -> BlockReceiver:
        if self._verify_thread and self._verifier is None:
            self._verifier = concurrent.futures.ThreadPoolExecutor(1, "p2p-verify")
        return BlockReceiver(self.identity.fingerprint, self.sink, self._verifier)

    # ---- one exchange -------------------------------------------------------------------------

    async def _exchange(
        self,
        target: _Producer,
        rid: KvRequestId,
        *,
        missing: tuple[OffloadKey, ...],
        deadline: float,
        finish: bool,
        progress: FetchProgress,
    ) -> None:
        host, port, expected_node_id = target.host, target.port, target.node_id
        session: Session | None = None
        ended_cleanly = False
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                session = await self._sessions.take((host, port), expected_node_id)
                if missing:
                    try:
                        await self._fetch_on(session, rid, missing, deadline, progress)
                    except PeerClosed:
                        if not (session.reused and progress.untouched):
                            raise
                        # An idle session the producer closed meanwhile: one fresh attempt.
                        session.channel.close()
                        session = await self._sessions.connect((host, port), expected_node_id)
                        await self._fetch_on(session, rid, missing, deadline, progress)
                if finish and progress.session_clean:
                    await session.channel.send_frame(Done(rid))
                ended_cleanly = progress.session_clean
        except TimeoutError:
            progress.reason = progress.reason or "deadline passed"
        except HandshakeRefused as exc:
            progress.reason = progress.reason or f"handshake refused: {exc}"
        except IntegrityError as exc:
            logger.warning("p2p fetch %s from %s:%d: %s; not installed", rid, host, port, exc)
            progress.reason = progress.reason or f"integrity: {exc}"
        except (P2PError, OSError) as exc:
            logger.warning("p2p fetch %s from %s:%d broke off: %s", rid, host, port, exc)
            progress.reason = progress.reason or f"transport: {exc}"
        finally:
            # Anything but a clean end (errors, cancellation) leaves the stream out of sync.
            if session is not None:
                if ended_cleanly:
                    self._sessions.give_back((host, port), session)
                else:
                    session.channel.close()
        if progress.reason is not None:
            logger.info(
                "p2p fetch %s: %d of %d keys fetched; %s",
                rid,
                len(progress.fetched),
                len(missing),
                progress.reason,
            )

    async def _fetch_on(
        self,
        session: Session,
        rid: KvRequestId,
        missing: tuple[OffloadKey, ...],
        deadline: float,
        progress: FetchProgress,
    ) -> None:
        step = self.settings.max_keys_per_fetch
        for start in range(0, len(missing), step):
            batch = missing[start : start + step]
            deadline_ms = max(int((deadline - time.monotonic()) * 1000), 0)
            await session.channel.send_frame(Fetch(rid, batch, deadline_ms))
            await self._receiver().receive(session.channel, rid, batch, progress)
            if progress.reason is not None:
                return


def _checked_id(kv_request_id: str) -> KvRequestId:
    if not isinstance(kv_request_id, str) or not 0 < len(kv_request_id) <= MAX_ID_CHARS:
        raise ValueError(f"kv_request_id must be a string of 1..{MAX_ID_CHARS} characters")
    return KvRequestId(kv_request_id)
