"""Which peers a request's leg may make this node connect to (``p2p_allowed_peers``).

A consumer leg's ``remote_host``/``remote_port`` come from the caller (the proxy copies them from
the producer's answer; in the NIXL dialect verbatim), and so does a ``remote_kv_source`` holder.
Without a check, anyone who can send a leg points this node at an address of their choosing: an
attacker's P2P server, or an internal service the node can reach and the attacker cannot (the
fetch, its ``done`` or the release of an aborted leg connect there). The allowlist bounds that:
:meth:`PeerAllowlist.refused` is the one check of every leg, in the reference worker (which
answers 400) and in vLLM's connector (whose scheduler runs the request without the leg).

Entries:

- ``*``: any producer (a trusted fabric where every caller is trusted; never the default);
- ``host`` or ``host:port``: that host name exactly (case-insensitive, no trailing dot), on any
  port or on that one;
- an IP address or network, ``10.0.0.7``, ``10.0.0.0/8``, ``fd00::/8``, optionally with a port:
  ``10.0.0.0/8:5600``, ``[fd00::/8]:5600``.

The empty list (the default) allows loopback only (``localhost``, ``127.0.0.0/8``, ``::1``),
enough for ``pdproxy up`` on one machine. Host names are compared as text and never resolved:
a DNS answer can change between this check and the connection (rebinding), so a network entry
admits only IP literals, and a host name is admitted only by its own entry. Address spellings
``ipaddress`` does not parse (``127.1``, ``2130706433``) are host names, so they match nothing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.worker.kv_params import ConsumerLeg, Leg, pull_source

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

ANY_PEER = "*"
LOOPBACK = ("localhost", "127.0.0.0/8", "::1")


@dataclass(frozen=True, slots=True)
class PeerRule:
    """One entry: a host name or an IP network, and the port it allows (None: any)."""

    host: str | None
    network: IPNetwork | None
    port: int | None

    def allows(self, host: str, address: IPAddress | None, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return address is not None and address in self.network
        return address is None and host == self.host


@dataclass(frozen=True, slots=True)
class NamedPeer:
    """A peer a leg makes this node connect to."""

    role: str
    """``producer`` (a consumer leg's) or ``remote_kv_source`` (the holder a leg pulls from)."""
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.role} {self.host}:{self.port}"


def named_peer(leg: Leg | None) -> NamedPeer | None:
    """The peer ``leg`` makes this node connect to, if any (a leg names at most one: a consumer
    leg with a ``remote_kv_source`` is malformed)."""
    if isinstance(leg, ConsumerLeg):
        return NamedPeer("producer", leg.remote_host, leg.remote_port)
    source = pull_source(leg)
    if source is not None:
        return NamedPeer("remote_kv_source", source.remote_host, source.remote_port)
    return None


@dataclass(frozen=True, slots=True)
class PeerAllowlist:
    rules: tuple[PeerRule, ...]
    any_peer: bool = False

    @classmethod
    def parse(cls, entries: Sequence[str]) -> PeerAllowlist:
        """The allowlist ``entries`` describe (empty: loopback only); ValueError names a bad
        entry."""
        if not entries:
            entries = LOOPBACK
        if ANY_PEER in entries:
            return cls((), any_peer=True)
        return cls(tuple(_rule(entry) for entry in entries))

    def refused(self, leg: Leg | None) -> NamedPeer | None:
        """The peer ``leg`` names that this list does not allow; None when the leg names no
        peer or an allowed one. Checked when a request arrives, before anything connects."""
        peer = named_peer(leg)
        return peer if peer is not None and not self.allows(peer.host, peer.port) else None

    def allows(self, host: str, port: int) -> bool:
        if self.any_peer:
            return True
        name = _host_name(host)
        address = _address(name)
        return any(rule.allows(name, address, port) for rule in self.rules)


def _host_name(host: str) -> str:
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name.rstrip(".")


def _address(name: str) -> IPAddress | None:
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _rule(entry: str) -> PeerRule:
    text = entry.strip()
    host, port = _split_port(text)
    if not host:
        raise ValueError(f"p2p_allowed_peers entry {entry!r} names no host")
    if "/" in host or _address(_host_name(host)) is not None:
        try:
            network = ipaddress.ip_network(_host_name(host), strict=False)
        except ValueError as exc:
            raise ValueError(f"p2p_allowed_peers entry {entry!r}: {exc}") from exc
        return PeerRule(None, network, port)
    return PeerRule(_host_name(host), None, port)


def _split_port(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 address/network."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"p2p_allowed_peers entry {text!r}: unclosed '['")
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"p2p_allowed_peers entry {text!r}: expected ':port' after ']'")
        return host, _port(rest[1:], text)
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return host, _port(port, text)
    return text, None  # no port, or a bare IPv6 address


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"p2p_allowed_peers entry {entry!r}: {text!r} is not a TCP port")
    return int(text)
