"""The one membership mechanism: sources join backends, drained backends leave when idle.

A *source* (``dns``, ``registration``) and an *owner* inside it (a DNS group, a registrant's
client key) own each backend they add. Joining adds a backend to the registry, refreshes it,
undrains it if this mechanism had drained it, or replaces it when its config changed (legs in
flight keep the old :class:`~pdproxy.fleet.backends.Backend` object and finish on it). Leaving only
drains: the backend is no longer routed to, and :meth:`Membership.sweep` removes it from the
registry once it has had no leg in flight for ``drain_grace_s`` (or after ``drain_timeout_s``),
so a backend that disappears from DNS or stops heartbeating never cuts a request short.

A source can only touch the backends it owns: a configured or admin-added backend, or one owned
by another source or owner, is a :class:`MemberConflict`, never replaced or drained. Names are
owned ahead of time too: a configured backend's name stays the config's after an admin removed
it, and every name in a DNS group's namespace (``<group>-...``) is DNS's, so no other source
can take a name DNS will give a backend it has not found yet.

The operator wins over sources. A backend the admin API drained stays drained whatever its
source says (refreshes, a changed config, leaving and coming back) until the operator undrains
it. One the admin API removed (or drained, and that then left) is remembered: a source that
joins with ``removal_sticks`` (worker registration) cannot bring it back until
:meth:`Membership.readmit` (or :meth:`Membership.readmit_owner`); DNS brings it back on its
next round, as DNS is the operator's own input.
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
from pdproxy.fleet.membership.errors import MemberConflict, MemberRemoved
from pdproxy.settings import BackendConfig
from pdproxy.settings.membership import MembershipSettings

log = logging.getLogger(__name__)

DNS_SOURCE = "dns"
"""The source whose group names reserve a namespace (:mod:`pdproxy.fleet.membership.dns`)."""


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
    held: bool = False
    """The admin API drained it: only the operator undrains it."""

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
        self._configured = frozenset(b.name for b in registry.all())
        """Names of the backends there before any source: the config's, even once removed."""
        self._dns_prefixes = tuple(f"{group.name}-" for group in settings.dns.groups)
        self._removed: dict[str, tuple[str, str]] = {}
        """Name -> (source, owner) of members the operator removed (grows only by admin
        actions)."""

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

    def removed(self) -> dict[str, tuple[str, str]]:
        """Names the operator removed and no source may bring back: name -> (source, owner)."""
        return dict(self._removed)

    # -- changing

    def readmit(self, name: str) -> bool:
        """The operator takes back a removed member: its source may add it again."""
        return self._removed.pop(name, None) is not None

    def readmit_owner(self, source: str, owner: str) -> None:
        """Take back every removed member of ``owner`` (its key was re-enabled)."""
        for name, (s, o) in list(self._removed.items()):
            if (s, o) == (source, owner):
                del self._removed[name]

    def join(
        self, source: str, owner: str, config: BackendConfig, *, removal_sticks: bool = False
    ) -> Member:
        """Add or refresh ``config`` as ``owner``'s (raises :class:`MemberConflict`; with
        ``removal_sticks``, :class:`MemberRemoved` for a backend the operator removed)."""
        now = self._clock()
        name = config.name
        self._check_name(source, name)
        member = self._members.get(name)
        live = self._registry.get(name)
        if member is not None and live is None:  # the admin API removed it
            del self._members[name]
            self._removed[name] = (member.source, member.owner)
            member = None
        if name in self._removed:
            if removal_sticks:
                raise MemberRemoved(f"backend {name!r} was removed by the operator")
            del self._removed[name]
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
        if live is not member.backend:  # the admin API put another backend under this name
            del self._members[name]
            self._conflict(source, f"backend {name!r} was replaced through the admin API")
        held = self._held(member)
        if member.backend.config != config:
            self._registry.remove(name)  # legs in flight finish on the old object
            member.backend = self._registry.add(config)
            member.backend.draining = held
            member.draining_since = member.idle_since = None
            self._metrics.changes.labels(source, "replaced").inc()
            log.info("membership: %s replaced from %s (%s)", name, source, config.url)
        elif member.draining:
            member.backend.draining = held
            member.draining_since = member.idle_since = None
            if not held:
                self._metrics.changes.labels(source, "undrained").inc()
                log.info("membership: %s is back from %s", name, source)
        member.seen_at = now
        return member

    def leave(self, name: str, reason: str) -> None:
        """Drain ``name`` (no new legs); :meth:`sweep` removes it once idle."""
        member = self._members.get(name)
        if member is None or member.draining:
            return
        self._held(member)
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
            live = self._registry.get(member.name)
            if live is not member.backend:  # the admin API removed or replaced it
                del self._members[member.name]
                if live is None:
                    self._removed[member.name] = (member.source, member.owner)
                continue
            held = self._held(member)
            if member.draining_since is None:
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
            if held:  # the operator drained it, then it left: it stays out
                self._removed[member.name] = (member.source, member.owner)
            removed.append(member.name)
            self._metrics.changes.labels(member.source, "removed").inc()
            log.info("membership: %s removed (%s)", member.name, member.leave_reason)
        return removed

    def _check_name(self, source: str, name: str) -> None:
        """Config and DNS win: their names, present or future, are not another source's."""
        if name in self._configured and self._registry.get(name) is None:
            self._conflict(source, f"backend {name!r} is the config's")
        if source != DNS_SOURCE and name.startswith(self._dns_prefixes):
            self._conflict(source, f"backend {name!r} is in a DNS group's namespace")

    @staticmethod
    def _held(member: Member) -> bool:
        """Whether the operator holds ``member`` drained: noticed when the backend is
        draining but this mechanism did not drain it; released when the operator undrains."""
        if member.backend.draining and member.draining_since is None:
            member.held = True
        elif not member.backend.draining:
            member.held = False
        return member.held

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
