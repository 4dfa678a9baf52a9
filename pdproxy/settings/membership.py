"""Settings of dynamic membership: DNS discovery, worker self-registration, draining.

Plain pydantic models embedded in the proxy's settings as ``membership:``; nothing here reads
the environment. Dialects are spelled as strings (not :class:`pdproxy.settings.Dialect`) so
that ``pdproxy.settings`` can import this module without a cycle.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from pdproxy.settings.backends import Role

DialectName = Literal["nixl", "p2p", "none"]
_GROUP_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,23}$")


class DnsGroup(BaseModel):
    """One DNS name whose records are a pool of backends of one role."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """Short group name; backends are named ``<name>-<address>-<port>``."""
    query: str
    """The DNS name, e.g. ``prefill.llm.svc.cluster.local`` (a headless Service) or
    ``_http._tcp.prefill.llm.svc.cluster.local`` for SRV."""
    record: Literal["a", "srv"] = "a"
    """``a``: A and AAAA records, each address on ``port``; ``srv``: SRV records, each target's
    addresses on the record's port."""
    port: int | None = Field(default=None, gt=0, lt=65536)
    """The HTTP port of every address (``a`` records only)."""
    role: Role
    dialect: DialectName = "nixl"
    scheme: Literal["http", "https"] = "http"
    api_key: SecretStr | None = None
    """Sent to each discovered backend as ``Authorization: Bearer <key>``."""
    models: tuple[str, ...] = ()
    kv_port: int | None = Field(default=None, gt=0, lt=65536)
    """Producers: the port of their KV address on the same host (checked against answers)."""
    events_port: int | None = Field(default=None, gt=0, lt=65536)
    """KV event PUB port on the same host (``tcp://<address>:<port>``)."""
    events_replay_port: int | None = Field(default=None, gt=0, lt=65536)
    health_path: str = "/health"

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _GROUP_RE.match(value):
            raise ValueError(f"group name must match {_GROUP_RE.pattern}")
        return value

    @model_validator(mode="after")
    def _port_for_a(self) -> DnsGroup:
        if self.record == "a" and self.port is None:
            raise ValueError(f"group {self.name}: A records need a port")
        if self.record == "srv" and self.port is not None:
            raise ValueError(f"group {self.name}: SRV records carry their own port")
        return self


class DnsDiscoverySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    groups: list[DnsGroup] = Field(default_factory=list)
    """Nothing is resolved while empty."""
    nameserver: str | None = None
    """``host`` or ``host:port`` of the DNS server to ask (default: the system's resolv.conf)."""
    interval_s: float = Field(default=5.0, gt=0)
    """Re-resolution interval (Kubernetes DNS caches for 5 s by default)."""
    timeout_s: float = Field(default=2.0, gt=0)
    """One resolution's deadline; a failed or timed-out resolution keeps the current set."""
    max_backends_per_group: int = Field(default=256, ge=1)
    """Records past this many are ignored (logged): a DNS answer cannot grow the proxy
    without bound."""

    @field_validator("nameserver")
    @classmethod
    def _check_nameserver(cls, value: str | None) -> str | None:
        if value is not None:
            nameserver_address(value)
        return value

    @model_validator(mode="after")
    def _unique_groups(self) -> DnsDiscoverySettings:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError("DNS group names must be unique")
        return self


def nameserver_address(value: str) -> tuple[str, int]:
    """``1.2.3.4``, ``1.2.3.4:5353``, ``[::1]:5353`` → (IP, port); DNS names are refused: the
    resolver must not need a resolver."""
    host, port = value, 53
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        if rest:
            port = int(rest.removeprefix(":"))
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
        port = int(port_text)
    ipaddress.ip_address(host)
    if not 0 < port < 65536:
        raise ValueError("nameserver port out of range")
    return host, port


class TrustedFabricSettings(BaseModel):
    """Opt-in: a second registration socket for stock vLLM, which cannot speak CURVE.

    It admits a connection (ZMQ's ZAP handler, before any message is read) only when the
    connection's source address is in ``networks``; anyone who can send from such an address
    can register backends that receive client prompts. Use it only on a fabric where every host
    in ``networks`` is trusted (a private cluster network), never on a shared or routed one.
    Everything else is the authenticated socket's: caps, rates, draining, the admin view."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = None
    """``tcp://host:port`` to bind (None, the default: no unauthenticated registration)."""
    networks: list[str] = Field(default_factory=list)
    """Source networks (CIDR) admitted to connect; required with ``endpoint``."""

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("tcp://"):
            raise ValueError("trusted_fabric endpoint must be tcp://host:port")
        return value

    @field_validator("networks")
    @classmethod
    def _check_networks(cls, value: list[str]) -> list[str]:
        for text in value:
            network = ipaddress.ip_network(text, strict=False)
            if network.prefixlen == 0:
                raise ValueError(
                    f"trusted_fabric network {text} admits every address: name the fabric's"
                )
        return value

    @model_validator(mode="after")
    def _networks_required(self) -> TrustedFabricSettings:
        if self.endpoint is not None and not self.networks:
            raise ValueError("trusted_fabric needs networks: the source networks it admits")
        return self


class RegistrationSettings(BaseModel):
    """The ZMQ socket that workers announce themselves to (vLLM's proxy registration).

    CURVE is required on ``endpoint``: the proxy holds a server certificate and admits only the
    client public keys in ``curve_clients_dir`` (``python -m kvtier.events.curve DIR NAME``
    writes a pair). ``trusted_fabric`` (off by default) adds a socket without CURVE for stock
    vLLM, admitting only source addresses in its networks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = None
    """``tcp://host:port`` to bind (None: no registration listener)."""
    trusted_fabric: TrustedFabricSettings = Field(default_factory=TrustedFabricSettings)
    """Stock vLLM's registration without CURVE, from these source networks only (opt-in)."""
    curve_secret_key_file: Path | None = None
    """The proxy's CURVE secret certificate (``NAME.key_secret``)."""
    curve_clients_dir: Path | None = None
    """Directory of the workers' public certificates (``*.key``) admitted to register. Re-read
    when it changes: deleting a key revokes it (its backends are drained, its messages and new
    handshakes refused); putting it back re-admits it."""
    keys_reload_s: float = Field(default=1.0, gt=0)
    """How often ``curve_clients_dir`` is checked for changes."""
    heartbeat_timeout_s: float = Field(default=5.0, gt=0)
    """A registrant silent this long is drained (vLLM pings every 3 s; its proxy waits 5 s)."""
    dialect: DialectName = "p2p"
    """Dialect of registrants that do not announce one."""
    api_key: SecretStr | None = None
    """Sent to every registered backend as ``Authorization: Bearer <key>``."""
    allowed_networks: list[str] = Field(default_factory=list)
    """Networks (CIDR) announced addresses may be in. Empty: a worker may only announce its
    own address (the source address of its ZMQ connection)."""
    max_registrants: int = Field(default=64, ge=1)
    max_models_per_key: int = Field(default=16, ge=1)
    """Most distinct model names one client key's backends may announce: each becomes a known
    model (a metric label, a router, an admission bucket) while a backend serves it."""
    max_models: int = Field(default=64, ge=1)
    """Most distinct model names all registrants together may announce."""
    max_message_bytes: int = Field(default=4096, ge=256, le=65536)
    """libzmq drops a connection whose message is larger, before allocating it."""
    max_messages_per_s: float = Field(default=200.0, gt=0)
    """All registrants together; messages past it are dropped (counted)."""
    max_messages_per_key_s: float = Field(default=10.0, gt=0)
    """Per client key (vLLM sends one every 3 s)."""
    handshake_timeout_s: float = Field(default=5.0, gt=0)
    """A connection that has not completed its CURVE handshake by then is closed."""

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("tcp://"):
            raise ValueError("registration endpoint must be tcp://host:port")
        return value

    @field_validator("allowed_networks")
    @classmethod
    def _check_networks(cls, value: list[str]) -> list[str]:
        for network in value:
            ipaddress.ip_network(network, strict=False)
        return value

    @property
    def listens(self) -> bool:
        """Whether any registration socket is configured (CURVE or trusted fabric)."""
        return self.endpoint is not None or self.trusted_fabric.endpoint is not None

    @model_validator(mode="after")
    def _curve_required(self) -> RegistrationSettings:
        if self.endpoint is not None and (
            self.curve_secret_key_file is None or self.curve_clients_dir is None
        ):
            raise ValueError(
                "registration needs curve_secret_key_file and curve_clients_dir: an "
                "unauthenticated sender must not be able to register backends"
            )
        return self


class MembershipSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dns: DnsDiscoverySettings = Field(default_factory=DnsDiscoverySettings)
    registration: RegistrationSettings = Field(default_factory=RegistrationSettings)
    drain_grace_s: float = Field(default=1.0, ge=0)
    """A drained backend is removed once it has had no leg in flight for this long (covers a
    request between its routing decision and its first leg)."""
    drain_timeout_s: float = Field(default=600.0, gt=0)
    """A drained backend is removed after this long even with legs in flight (those legs
    still finish: they hold the backend)."""
    poll_s: float = Field(default=0.2, gt=0)
    """How often drained backends are checked for removal and registrants for expiry."""

    @model_validator(mode="after")
    def _dns_does_not_own_registered_names(self) -> MembershipSettings:
        if self.registration.listens and any(group.name == "reg" for group in self.dns.groups):
            raise ValueError(
                "DNS group 'reg' would own every registered worker's name (reg-<address>-<port>):"
                " rename the group"
            )
        return self
