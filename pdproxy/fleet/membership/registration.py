"""Worker self-registration: a ZMQ socket that workers announce themselves and heartbeat to.

The message is vLLM's (:mod:`kvtier.announce`): a worker's DEALER sends it every few seconds;
the first one joins the backend, later ones refresh it, ``leaving`` drains it at once, and a
registrant silent for ``heartbeat_timeout_s`` is drained. Drained registrants are removed once
their legs in flight have ended (:class:`~pdproxy.fleet.membership.members.Membership`).

The proxy's socket is a DEALER (vLLM's proxy binds a ROUTER; a DEALER talks to a DEALER): a
ROUTER keys its peers by the routing id each one chooses (vLLM's is its predictable
``zmq_address``) and ignores a second peer under a taken id, so whoever connected first under a
worker's id kept that worker out. The proxy never answers, so it needs no routing id: a sender
is its CURVE public key (the ``User-Id`` the ZAP handler gives each message).

Threat model (who may connect, what they can make the proxy do):

- *Anyone who reaches the port* can open TCP connections. Without a CURVE client key that the
  proxy admits (``curve_clients_dir``), the handshake fails in libzmq and nothing reaches this
  code: no registration, drain or replacement. Connections that do not finish the handshake
  are closed after ``handshake_timeout_s``; the number of open connections is not capped here
  (libzmq has no such option): firewall the port to the workers' network.
- *An admitted worker* (a key in the directory) can register backends, but only at its own
  address (the source address of its connection; ``allowed_networks`` widens that), never a
  name that belongs to a configured backend (even one an admin removed), a DNS group's
  namespace (``<group>-...``), another address's generated name (``reg-<address>-<port>``) or
  another key (:class:`MemberConflict` by owner = client key), at most ``max_registrants``
  backends in all, announcing at most ``max_models_per_key`` distinct model names (all keys:
  ``max_models``), and it can drain or replace only what its own key registered. Every
  announced host must be an IP literal; a wildcard events endpoint (which would make the proxy
  bind) is refused by the wire format.
- *The operator wins*: a registered backend removed or drained through the admin API stays out
  (or drained) whatever its key announces, until re-admitted
  (:meth:`Membership.readmit <pdproxy.fleet.membership.members.Membership.readmit>`) or its key
  is re-enabled. Deleting a key's file revokes it within ``keys_reload_s``: its backends are
  drained, its messages refused (``revoked``), new handshakes with it fail
  (:mod:`~pdproxy.fleet.membership.keys`).
- *Memory*: libzmq drops any message over ``max_message_bytes`` before allocating it; at most
  ``RCVHWM`` messages queue per connection; messages past ``max_messages_per_s`` (all) or
  ``max_messages_per_key_s`` (per key) are dropped before decoding; decoding bounds every
  string, list and map (:func:`kvtier.announce.decode`).
- Registered backends receive client prompts and ``api_key``: only admit keys of workers you
  would list in the config.
- *Stock vLLM without CURVE* (``trusted_fabric``, off by default): a second socket admits
  connections by source network instead of by key; its own threat model is in
  :mod:`~pdproxy.fleet.membership.fabric`. Its messages go through :meth:`accept` like the
  others, owned by their source address.

Attacker tests: ``tests/pdproxy/fleet/membership/test_registration_attacker.py`` (sockets) and
``test_registration_claims.py`` (what an admitted key may claim).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import re
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from kvtier.announce import Announcement, decode
from kvtier.errors import AnnouncementError
from kvtier.events.curve import ZapHandler, load_server, make_server
from kvtier.token_bucket import TokenBucket, TokenBuckets
from pdproxy.fleet.membership.errors import AnnouncementRefused, MemberConflict, MemberRemoved
from pdproxy.fleet.membership.fabric import address_gate, fabric_owner, fabric_socket
from pdproxy.fleet.membership.keys import AdmittedKeys, KeyChange, key_gate
from pdproxy.fleet.membership.members import Membership
from pdproxy.settings import BackendConfig, Dialect
from pdproxy.settings.backends import Role
from pdproxy.settings.membership import RegistrationSettings

log = logging.getLogger(__name__)

_MAX_TRACKED_SENDERS = 4096
"""Per-sender rate buckets kept (admitted keys, trusted-fabric source addresses): the least
recently heard from past it are forgotten, so a fabric of many addresses cannot grow the table."""

SOURCE = "registration"
GENERATED_PREFIX = "reg-"
"""Names the listener makes from an address (``reg-<address>-<port>``)."""
_ROLES = {"P": Role.PRODUCER, "D": Role.CONSUMER, "PD": Role.BOTH}
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_RCVHWM = 1024


def key_id(client_key: str) -> str:
    """A short, stable label for a client public key (admin listing, logs)."""
    return hashlib.blake2s(client_key.encode(), digest_size=6).hexdigest()


class RegistrationListener:
    def __init__(
        self,
        settings: RegistrationSettings,
        membership: Membership,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._settings = settings
        self._membership = membership
        self._clock = clock
        self._networks = [ipaddress.ip_network(n, strict=False) for n in settings.allowed_networks]
        everyone = settings.max_messages_per_s
        self._all = TokenBucket.full(everyone, max(everyone, 1.0), clock())
        self._fabric_networks = [
            ipaddress.ip_network(n, strict=False) for n in settings.trusted_fabric.networks
        ]
        per_key = settings.max_messages_per_key_s
        self._per_key = TokenBuckets(
            per_key, max(per_key, 1.0), max_keys=_MAX_TRACKED_SENDERS, clock=clock
        )
        self._sockets: list[tuple[zmq.asyncio.Context, ZapHandler, zmq.asyncio.Socket]] = []
        """Per bound socket: its own context (one ZAP handler per context) and handler."""
        self._gate: ZapHandler | None = None
        self._fabric_gate: ZapHandler | None = None
        self._keys: AdmittedKeys | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.endpoint: str | None = None
        """The bound CURVE endpoint (the port filled in when the setting's was 0)."""
        self.fabric_endpoint: str | None = None
        """The bound trusted-fabric endpoint (None: not configured)."""
        self.messages = Counter(
            "pdproxy_registration_messages",
            "Registration messages by outcome (joined, refreshed, left, malformed, address, "
            "full, models, conflict, owner, removed, revoked, rate, frames)",
            ["outcome"],
            registry=metrics_registry,
        )

    @property
    def refused_handshakes(self) -> int:
        """CURVE handshakes the gate refused (unknown client keys)."""
        return self._gate.refused if self._gate is not None else 0

    @property
    def refused_fabric_peers(self) -> int:
        """Trusted-fabric connections refused (source address outside its networks)."""
        return self._fabric_gate.refused if self._fabric_gate is not None else 0

    async def start(self) -> None:
        s = self._settings
        if not s.listens or self._tasks:
            return
        loop = asyncio.get_running_loop()
        try:
            if s.endpoint is not None:
                sock = self._open_curve(s.endpoint)
                self._tasks += [
                    loop.create_task(
                        self._receive(sock, trusted=False), name="pdproxy-registration"
                    ),
                    loop.create_task(self._watch_keys(), name="pdproxy-registration-keys"),
                ]
                log.info("registration: listening on %s (CURVE)", self.endpoint)
            if s.trusted_fabric.endpoint is not None:
                sock = self._open_fabric(s.trusted_fabric.endpoint)
                receive = self._receive(sock, trusted=True)
                self._tasks.append(loop.create_task(receive, name="pdproxy-registration-fabric"))
                log.warning(
                    "registration: listening on %s WITHOUT authentication for sources in %s "
                    "(trusted fabric only)",
                    self.fabric_endpoint, ", ".join(s.trusted_fabric.networks),
                )  # fmt: skip
            self._tasks.append(loop.create_task(self._expire(), name="pdproxy-registration-expiry"))
        except BaseException:
            await self.close()
            raise

    def _open_curve(self, endpoint: str) -> zmq.asyncio.Socket:
        s = self._settings
        assert s.curve_secret_key_file is not None and s.curve_clients_dir is not None
        keys = load_server(s.curve_secret_key_file, s.curve_clients_dir)
        self._keys = AdmittedKeys(s.curve_clients_dir)
        ctx = zmq.asyncio.Context()  # its own: the ZAP handler is per context
        self._gate = key_gate(ctx, self._keys)
        sock = self._bind(ctx, self._gate, endpoint, lambda sock: make_server(sock, keys))
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def _open_fabric(self, endpoint: str) -> zmq.asyncio.Socket:
        ctx = zmq.asyncio.Context()
        self._fabric_gate = address_gate(ctx, self._fabric_networks)
        sock = self._bind(ctx, self._fabric_gate, endpoint, fabric_socket)
        self.fabric_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock

    def _bind(
        self,
        ctx: zmq.asyncio.Context,
        gate: ZapHandler,
        endpoint: str,
        secure: Callable[[zmq.asyncio.Socket], None],
    ) -> zmq.asyncio.Socket:
        """A DEALER (not ROUTER: peers choose no id here) with the listener's limits,
        ``secure`` applied and ``gate`` serving before it binds, so no peer is ever admitted
        without it; :meth:`close` releases all three."""
        s = self._settings
        sock = ctx.socket(zmq.DEALER)
        self._sockets.append((ctx, gate, sock))
        gate.start()
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(s.handshake_timeout_s * 1000))
        secure(sock)
        sock.bind(endpoint)
        return sock

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sockets, self._sockets = self._sockets, []
        for ctx, gate, sock in sockets:
            await gate.stop()
            sock.close(linger=0)
            ctx.term()
        self._gate = self._fabric_gate = None
        self._keys = None

    async def _receive(self, sock: zmq.asyncio.Socket, *, trusted: bool) -> None:
        """``trusted``: the fabric socket, whose senders are their source addresses."""
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) != 1:  # one message frame, as vLLM's DEALER sends
                self.messages.labels("frames").inc()
                continue
            last = frames[-1]
            peer = str(last.get("Peer-Address"))
            try:
                key = None if trusted else str(last.get("User-Id"))
                outcome = self.accept(last.bytes, key, peer)
            except Exception:
                log.exception("registration: message handling failed")
                outcome = "error"
            self.messages.labels(outcome).inc()

    async def _expire(self) -> None:
        timeout = self._settings.heartbeat_timeout_s
        while True:
            await asyncio.sleep(min(timeout / 4, 1.0))
            self._membership.expire(SOURCE, timeout)

    async def _watch_keys(self) -> None:
        while True:
            await asyncio.sleep(self._settings.keys_reload_s)
            try:
                self.reload_keys()
            except Exception:
                log.exception("registration: reloading the client keys failed")

    def reload_keys(self) -> KeyChange | None:
        """Re-read ``curve_clients_dir`` if it changed (every ``keys_reload_s``; an admin call
        may too): revoked keys' backends are drained, re-enabled keys' removals forgotten."""
        if self._keys is None:
            return None
        change = self._keys.reload()
        if change is None:
            return None
        for key in change.revoked:
            owner = key_id(key)
            self._per_key.forget(key)
            for member in self._membership.members(SOURCE):
                if member.owner == owner:
                    self._membership.leave(member.name, "client key revoked")
        for key in change.added:
            self._membership.readmit_owner(SOURCE, key_id(key))
        return change

    def accept(self, payload: bytes, client_key: str | None, peer: str) -> str:
        """Act on one admitted message; the outcome label. ``client_key`` is the sender's
        CURVE public key (z85), or None for the trusted-fabric socket (whose sender is its
        source address); ``peer`` is its connection's source address. Event loop only."""
        if (
            client_key is not None
            and self._keys is not None
            and client_key not in self._keys.allowed
        ):
            return "revoked"  # a connection made before its key was revoked
        owner = key_id(client_key) if client_key is not None else fabric_owner(peer)
        if not self._all.take(self._clock()):
            return "rate"
        if not self._per_key.take(client_key if client_key is not None else owner):
            return "rate"
        try:
            announcement = decode(payload)
            self._check_addresses(announcement, peer)
        except AnnouncementError as exc:
            log.debug("registration: malformed announcement from %s: %s", owner, exc)
            return "malformed"
        except AnnouncementRefused as exc:
            log.warning("registration: refused %s: %s", owner, exc)
            return exc.reason
        config = self.backend_config(announcement)
        if config.name.startswith(GENERATED_PREFIX) and config.name != _generated_name(
            announcement.http_address
        ):
            log.warning("registration: %s may not announce %s", owner, config.name)
            return "conflict"  # another address's generated name
        member = self._membership.get(config.name)
        if member is not None and (member.source, member.owner) != (SOURCE, owner):
            log.warning("registration: %s may not announce %s", owner, config.name)
            return "owner"
        if announcement.leaving:
            if member is None:
                return "unknown"
            self._membership.leave(config.name, "announced leaving")
            return "left"
        if member is None and self._membership.count(SOURCE) >= self._settings.max_registrants:
            log.warning("registration: %d registrants, refusing %s", self._membership.count(SOURCE),
                        config.name)  # fmt: skip
            return "full"
        if (member is None or member.backend.config.models != config.models) and not (
            self._models_fit(owner, config)
        ):
            log.warning("registration: %s: models of %s over the caps", owner, config.name)
            return "models"
        try:
            self._membership.join(SOURCE, owner, config, removal_sticks=True)
        except MemberConflict as exc:
            log.warning("registration: %s", exc)
            return "conflict"
        except MemberRemoved as exc:
            log.debug("registration: %s", exc)
            return "removed"
        return "refreshed" if member is not None else "joined"

    def _models_fit(self, owner: str, config: BackendConfig) -> bool:
        """Within ``max_models_per_key`` for ``owner`` and ``max_models`` in all, once
        ``config`` replaces what its name announced before."""
        own = set(config.models)
        every = set(config.models)
        for member in self._membership.members(SOURCE):
            if member.name == config.name:
                continue
            models = member.backend.config.models
            every.update(models)
            if member.owner == owner:
                own.update(models)
        return len(own) <= self._settings.max_models_per_key and (
            len(every) <= self._settings.max_models
        )

    def _check_addresses(self, announcement: Announcement, peer: str) -> None:
        for host in announcement.hosts():
            try:
                address = ipaddress.ip_address(host)
            except ValueError:
                raise AnnouncementRefused(
                    "address", "announced hosts must be IP addresses"
                ) from None
            if self._networks:
                if not any(address in network for network in self._networks):
                    raise AnnouncementRefused("address", f"{address} is not in allowed_networks")
            elif _unmapped(address) != _unmapped(ipaddress.ip_address(peer)):
                raise AnnouncementRefused(
                    "address", f"{address} is not the sender's own address {peer}"
                )

    def backend_config(self, announcement: Announcement) -> BackendConfig:
        role = _ROLES[announcement.kind]
        name = announcement.name or _generated_name(announcement.http_address)
        # Kept for every role: every worker is a P2P holder, and a consumer's address is where
        # a pull (remote_kv_source) fetches from. It is never a producer's address: a consumer
        # is never a producer candidate, and the hosts were checked like the others above.
        return BackendConfig(
            name=name[:64],
            url=f"http://{announcement.http_address}",
            role=role,
            dialect=Dialect(announcement.dialect or self._settings.dialect),
            api_key=self._settings.api_key,
            models=announcement.models,
            kv_address=announcement.kv_address,
            events_endpoint=announcement.events_endpoint,
            events_replay_endpoint=announcement.events_replay_endpoint,
            data_parallel_size=announcement.dp_size,
        )


def _generated_name(http_address: str) -> str:
    host, port = http_address.rsplit(":", 1)
    return f"{GENERATED_PREFIX}{_UNSAFE.sub('-', host.strip('[]'))}-{port}"[:64]


def _unmapped(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """An IPv4-mapped IPv6 address (``::ffff:1.2.3.4``) compares equal to its IPv4 form."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)
