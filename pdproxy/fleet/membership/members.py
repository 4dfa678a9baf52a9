"""The one membership mechanism: sources join backends, drained backends leave when idle.

A *source* (``dns``, ``registration``) and an *owner* inside it (a DNS group, a registrant's
client key) own each backend they add. Joining adds a backend to the registry, refreshes it,
undrains it if this mechanism had drained it, or replaces it when its config changed (legs in
flight keep the old :class:`~pdproxy.fleet.backends.Backend` object and finish on it). Leaving only
drains: the backend is no longer routed to, and :meth:`Membership.sweep` removes it from the
registry once it has had no leg in flight for ``drain_grace_s`` (or after ``drain_timeout_s``),
so a backend that disappears from DNS or stops heartbeating never cuts a request short.

A source can only touch the backends it owns: a configured or admin-added backend, or one owned
by another source or owner, is a :class:`MemberConflict`, never replaced or drained.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from kvtier.tasks import cancel_and_wait
from pdproxy.fleet.backends import Backend, BackendRegistry
from pdproxy.fleet.membership.errors import MemberConflict
from pdproxy.settings import BackendConfig
from pdproxy.settings.membership import MembershipSettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Member:
    name: str
    source: str
    owner: str
    backend: Backend
    joined_at: float
    seen_at: float
    draining_since: float | None = None
    idle_since: float | None = None
    leave_reason: str = ""

    @property
    def draining(self) -> bool:
        return self.draining_since is not None


class MembershipMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.changes = Counter(
            "pdproxy_membership_changes",
            "Backends joined, replaced, drained, undrained and removed, by source",
            ["source", "change"],
            registry=registry,
        )
        self.conflicts = Counter(
            "pdproxy_membership_conflicts",
            "Joins refused because the name belongs to another owner",
            ["source"],
            registry=registry,
        )


class Membership:
    def __init__(
        self,
        registry: BackendRegistry,
        settings: MembershipSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: MembershipMetrics | None = None,
    ) -> None:
        self._registry = registry
        self._settings = settings
        self._clock = clock
        self._metrics = metrics or MembershipMetrics(None)
        self._members: dict[str, Member] = {}
        self._task: asyncio.Task[None] | None = None

    # -- reading

    def members(self, source: str | None = None) -> list[Member]:
        return [m for m in self._members.values() if source is None or m.source == source]

    def get(self, name: str) -> Member | None:
        return self._members.get(name)

    def count(self, source: str, owner: str | None = None) -> int:
        return sum(
            1
            for m in self._members.values()
            if m.source == source and (owner is None or m.owner == owner)
        )

    # -- changing

    def join(self, source: str, owner: str, config: BackendConfig) -> Member:
        """Add or refresh ``config`` as ``owner``'s (raises :class:`MemberConflict`)."""
        now = self._clock()
        name = config.name
        member = self._members.get(name)
        live = self._registry.get(name)
        if member is None:
            if live is not None:
                self._conflict(source, f"backend {name!r} is configured, not {source}'s")
            member = Member(name, source, owner, self._registry.add(config), now, now)
            self._members[name] = member
            self._metrics.changes.labels(source, "joined").inc()
            log.info("membership: %s joined from %s (%s)", name, source, config.url)
            return member
        if (member.source, member.owner) != (source, owner):
            self._conflict(source, f"backend {name!r} belongs to another {member.source} owner")
        if live is not member.backend:
            if live is not None:  # the admin API put another backend under this name
                del self._members[name]
                self._conflict(source, f"backend {name!r} was replaced through the admin API")
            member.backend = self._registry.add(config)  # the admin API removed it: back
            member.draining_since = member.idle_since = None
            self._metrics.changes.labels(source, "joined").inc()
        elif member.backend.config != config:
            self._registry.remove(name)  # legs in flight finish on the old object
            member.backend = self._registry.add(config)
            member.draining_since = member.idle_since = None
            self._metrics.changes.labels(source, "replaced").inc()
            log.info("membership: %s replaced from %s (%s)", name, source, config.url)
        elif member.draining:
            member.backend.draining = False
            member.draining_since = member.idle_since = None
            self._metrics.changes.labels(source, "undrained").inc()
            log.info("membership: %s is back from %s", name, source)
        member.seen_at = now
        return member

    def leave(self, name: str, reason: str) -> None:
        """Drain ``name`` (no new legs); :meth:`sweep` removes it once idle."""
        member = self._members.get(name)
        if member is None or member.draining:
            return
        member.backend.draining = True
        member.draining_since = self._clock()
        member.idle_since = None
        member.leave_reason = reason
        self._metrics.changes.labels(member.source, "drained").inc()
        log.info(
            "membership: %s draining (%s; %d legs in flight)",
            name, reason, member.backend.in_flight,
        )  # fmt: skip

    def sync(self, source: str, owner: str, configs: Iterable[BackendConfig]) -> None:
        """Make ``owner``'s backends exactly ``configs``: join each, drain the rest."""
        wanted: set[str] = set()
        for config in configs:
            try:
                self.join(source, owner, config)
            except MemberConflict as exc:
                log.warning("membership: %s", exc)
                continue
            wanted.add(config.name)
        for member in self.members(source):
            if member.owner == owner and member.name not in wanted:
                self.leave(member.name, f"gone from {source}")

    def expire(self, source: str, silent_s: float) -> None:
        """Drain ``source``'s members not seen for ``silent_s`` (heartbeats)."""
        now = self._clock()
        for member in self.members(source):
            if not member.draining and now - member.seen_at > silent_s:
                self.leave(member.name, f"no heartbeat for {now - member.seen_at:.1f} s")

    def sweep(self) -> list[str]:
        """Remove drained members that are idle (or past the drain timeout); their names."""
        now = self._clock()
        removed = []
        for member in list(self._members.values()):
            if member.draining_since is None:
                continue
            if self._registry.get(member.name) is not member.backend:
                del self._members[member.name]  # the admin API removed it already
                continue
            if not member.backend.draining:  # undrained through the admin API: it stays
                member.draining_since = member.idle_since = None
                continue
            if member.backend.in_flight == 0:
                if member.idle_since is None:
                    member.idle_since = now
                if now - member.idle_since < self._settings.drain_grace_s:
                    continue
            else:
                member.idle_since = None
                if now - member.draining_since < self._settings.drain_timeout_s:
                    continue
                log.warning(
                    "membership: %s removed after the drain timeout with %d legs in flight",
                    member.name, member.backend.in_flight,
                )  # fmt: skip
            self._registry.remove(member.name)
            del self._members[member.name]
            removed.append(member.name)
            self._metrics.changes.labels(member.source, "removed").inc()
            log.info("membership: %s removed (%s)", member.name, member.leave_reason)
        return removed

    def _conflict(self, source: str, message: str) -> None:
        self._metrics.conflicts.labels(source).inc()
        raise MemberConflict(message)

    # -- background

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="pdproxy-membership-sweep"
            )

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.poll_s)
            try:
                self.sweep()
            except Exception:
                log.exception("membership: sweep failed")
