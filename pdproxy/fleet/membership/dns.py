"""DNS discovery: each group's DNS name, re-resolved on an interval, is its pool of backends.

``record: a`` asks for A and AAAA records (a Kubernetes headless Service answers one address per
ready pod) and puts every address on the group's port; ``record: srv`` asks for SRV records and
resolves each target's A/AAAA, on the record's port (priorities and weights are not used: every
target is a backend). Each round hands the group's full set to
:meth:`Membership.sync <pdproxy.fleet.membership.members.Membership.sync>`: new addresses join,
vanished ones are drained and removed once idle.

A name that does not exist (NXDOMAIN) or has no records of the type is an empty pool (scaled to
zero). A resolution that fails (timeout, SERVFAIL, refused, unreachable server) changes nothing:
a DNS outage must not drain every backend. Queries go to ``nameserver`` when set, with no cache
(the server's TTLs are its business; the interval bounds how often it is asked).

Threat model: the proxy sends client prompts (and each group's ``api_key``) to whatever the
answers name, so the DNS server and the path to it are trusted (in Kubernetes, the cluster DNS).
An answer can at most put ``max_backends_per_group`` backends per group in the registry.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import re

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdata
import dns.resolver
from dns.rdtypes.IN.A import A
from dns.rdtypes.IN.AAAA import AAAA
from dns.rdtypes.IN.SRV import SRV
from prometheus_client import CollectorRegistry, Counter

from kvtier.tasks import cancel_and_wait
from pdproxy.fleet.membership.members import DNS_SOURCE, Membership
from pdproxy.settings import BackendConfig, Dialect
from pdproxy.settings.membership import DnsDiscoverySettings, DnsGroup, nameserver_address

log = logging.getLogger(__name__)

SOURCE = DNS_SOURCE
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ResolutionFailed(Exception):
    """This round's answer for a group is unknown (not empty): keep the current set."""


class DnsDiscovery:
    def __init__(
        self,
        settings: DnsDiscoverySettings,
        membership: Membership,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._settings = settings
        self._membership = membership
        self._resolver = _resolver(settings)
        self._task: asyncio.Task[None] | None = None
        self._resolutions = Counter(
            "pdproxy_dns_resolutions",
            "DNS discovery rounds by group and outcome (ok, failed)",
            ["group", "outcome"],
            registry=metrics_registry,
        )

    async def start(self) -> None:
        if self._settings.groups and self._task is None:
            await self.resolve_all()  # the first set is there before the app serves
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="pdproxy-dns-discovery"
            )

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._settings.interval_s)
            await self.resolve_all()

    async def resolve_all(self) -> None:
        """One round: resolve every group and apply what resolved."""
        groups = self._settings.groups
        results = await asyncio.gather(*(self.backends(g) for g in groups), return_exceptions=True)
        for group, result in zip(groups, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, ResolutionFailed):
                    log.error("DNS discovery of %s failed", group.name, exc_info=result)
                else:
                    log.warning("DNS discovery of %s: %s; keeping its backends", group.name, result)
                self._resolutions.labels(group.name, "failed").inc()
                continue
            self._resolutions.labels(group.name, "ok").inc()
            self._membership.sync(SOURCE, group.name, result)

    async def backends(self, group: DnsGroup) -> list[BackendConfig]:
        """The group's backends as DNS says now (raises :class:`ResolutionFailed`)."""
        if group.record == "a":
            assert group.port is not None
            targets = [(address, group.port) for address in await self._addresses(group.query)]
        else:
            targets = []
            for host, port in await self._srv(group.query):
                targets += [(address, port) for address in await self._addresses(host)]
        unique = sorted(set(targets), key=_order)
        limit = self._settings.max_backends_per_group
        if len(unique) > limit:
            log.warning(
                "DNS discovery of %s: %d backends, keeping the first %d",
                group.name, len(unique), limit,
            )  # fmt: skip
            unique = unique[:limit]
        return [backend_config(group, address, port) for address, port in unique]

    async def _addresses(self, name: str) -> list[str]:
        found: list[str] = []
        for rdtype in ("A", "AAAA"):
            answer = await self._query(name, rdtype)
            found += [r.address for r in answer if isinstance(r, A | AAAA)]
        return found

    async def _srv(self, name: str) -> list[tuple[str, int]]:
        answer = await self._query(name, "SRV")
        return [
            (r.target.to_text(omit_final_dot=True), r.port) for r in answer if isinstance(r, SRV)
        ]

    async def _query(self, name: str, rdtype: str) -> list[dns.rdata.Rdata]:
        try:
            answer = await self._resolver.resolve(
                name, rdtype, lifetime=self._settings.timeout_s, search=False
            )
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            raise ResolutionFailed(f"{rdtype} {name}: {type(exc).__name__}") from exc
        return list(answer)


def backend_config(group: DnsGroup, address: str, port: int) -> BackendConfig:
    """The backend one record names; its name is stable for the same address and port."""
    ip = ipaddress.ip_address(address)
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    name = f"{group.name}-{_UNSAFE.sub('-', str(ip))}-{port}"
    if len(name) > 64:
        digest = hashlib.blake2s(f"{ip}:{port}".encode(), digest_size=6).hexdigest()
        name = f"{group.name}-{digest}"
    return BackendConfig(
        name=name,
        url=f"{group.scheme}://{host}:{port}",
        role=group.role,
        dialect=Dialect(group.dialect),
        api_key=group.api_key,
        models=group.models,
        health_path=group.health_path,
        kv_address=f"{host}:{group.kv_port}" if group.kv_port else None,
        events_endpoint=f"tcp://{host}:{group.events_port}" if group.events_port else None,
        events_replay_endpoint=(
            f"tcp://{host}:{group.events_replay_port}" if group.events_replay_port else None
        ),
    )


def _order(target: tuple[str, int]) -> tuple[int, int, int]:
    """IPv4 before IPv6, then by address and port: a stable order for the per-group cap."""
    ip = ipaddress.ip_address(target[0])
    return ip.version, int(ip), target[1]


def _resolver(settings: DnsDiscoverySettings) -> dns.asyncresolver.Resolver:
    if settings.nameserver is None:
        resolver = dns.asyncresolver.Resolver(configure=True)
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        host, port = nameserver_address(settings.nameserver)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(host, port)]
    resolver.cache = None
    resolver.lifetime = settings.timeout_s
    return resolver
