"""``MembershipService``: the membership mechanism and its two sources, started and stopped
together by the app, and the view the admin API lists (``GET /admin/members``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.membership.dns import DnsDiscovery
from pdproxy.fleet.membership.members import Member, Membership, MembershipMetrics
from pdproxy.fleet.membership.registration import RegistrationListener
from pdproxy.settings.membership import MembershipSettings


class MembershipService:
    def __init__(
        self,
        settings: MembershipSettings,
        registry: BackendRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._clock = clock
        self._enabled = bool(settings.dns.groups) or settings.registration.listens
        self.membership = Membership(
            registry, settings, clock=clock, metrics=MembershipMetrics(metrics_registry)
        )
        self.dns = DnsDiscovery(settings.dns, self.membership, metrics_registry)
        self.registration = RegistrationListener(
            settings.registration, self.membership, clock=clock, metrics_registry=metrics_registry
        )

    async def start(self) -> None:
        if not self._enabled:
            return
        await self.membership.start()
        try:
            await self.registration.start()
            await self.dns.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        await self.dns.close()
        await self.registration.close()
        await self.membership.close()

    def view(self) -> list[dict[str, Any]]:
        """Every dynamic member with its state, for the admin API."""
        now = self._clock()
        return [self._member_state(m, now) for m in self.membership.members()]

    @staticmethod
    def _member_state(member: Member, now: float) -> dict[str, Any]:
        backend = member.backend
        return {
            "name": member.name,
            "source": member.source,
            "owner": member.owner,
            "url": backend.url,
            "role": backend.role.value,
            "dialect": backend.dialect.value,
            "models": list(backend.config.models),
            "kv_address": backend.config.kv_address,
            "events_endpoint": backend.config.events_endpoint,
            "state": "draining" if member.draining else "active",
            "leave_reason": member.leave_reason or None,
            "in_flight": backend.in_flight,
            "healthy": backend.healthy,
            "seen_s_ago": round(now - member.seen_at, 3),
            "member_for_s": round(now - member.joined_at, 3),
        }
