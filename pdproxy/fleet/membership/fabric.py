"""The trusted-fabric registration socket: stock vLLM's registration, without CURVE.

vLLM's own registration sender (the MoRIIO connector's heartbeat in vLLM 0.32, the P2P NCCL
connector's ``ping`` before it) is a plain ZMQ DEALER: it cannot present a CURVE key, so the
authenticated socket (:mod:`~pdproxy.fleet.membership.registration`) refuses it. This socket is
opt-in (``membership.registration.trusted_fabric``, off by default) and has no cryptographic
authentication: its ZAP handler admits a connection only when libzmq reports its source address
in ``networks``, before any message of it is read. Admitted messages go through the same
:meth:`RegistrationListener.accept
<pdproxy.fleet.membership.registration.RegistrationListener.accept>` as authenticated ones
(caps, rates, names, draining, the admin view), with the source address as their owner.

Threat model (who may connect, what they can make the proxy do):

- *Anyone outside* ``networks``: their handshake is refused by the ZAP handler; nothing they
  send is read. Connections that never finish the ZMTP handshake close after
  ``handshake_timeout_s``; as on the CURVE socket, the number of open connections is not capped
  here: firewall the port to the fabric.
- *Anyone who can send from an address in* ``networks`` (every host there, and anyone who can
  spoof such a source address on that network: a TCP handshake must complete, so blind
  spoofing from afar does not work, but an on-path attacker's does) can register backends at
  its own address (``allowed_networks`` widens that, as for keys), which then receive client
  prompts, and can drain what its own address registered. It cannot take a configured
  backend's name, a DNS group's namespace, another owner's backend, or exceed the registrant,
  model and message caps. That is why this is for a trusted fabric only: the network is the
  credential.
- One owner per source address: every vLLM on one host shares its caps (``max_models_per_key``,
  ``max_messages_per_key_s``) and may drain the others' backends.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvtier.events.curve import ZapHandler, ZapRequest

ZAP_DOMAIN = "pdproxy-registration-fabric"
"""Set on the socket so libzmq asks the ZAP handler about NULL-mechanism peers too."""
OWNER_PREFIX = "fabric:"
"""Owners of trusted-fabric registrants are ``fabric:<source address>``."""

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def fabric_owner(peer: str) -> str:
    return f"{OWNER_PREFIX}{peer}"


def source_admitted(address: str, networks: Sequence[Network]) -> bool:
    """Whether a peer's source address (as libzmq reports it) is in ``networks``; an
    IPv4-mapped IPv6 address counts as its IPv4 form."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in network for network in networks)


def address_gate(context: zmq.asyncio.Context, networks: Sequence[Network]) -> ZapHandler:
    """The ZAP handler of the fabric socket's context: admits NULL-mechanism peers (plain ZMQ,
    as vLLM sends) from ``networks`` under their address as user id; refuses everyone else."""

    def decide(request: ZapRequest) -> bytes | None:
        if request.mechanism != b"NULL" or request.domain != ZAP_DOMAIN.encode():
            return None
        if not source_admitted(request.address, networks):
            return None
        return request.address.encode()

    return ZapHandler(context, decide)


def fabric_socket(sock: zmq.asyncio.Socket) -> None:
    """Before ``bind``: libzmq asks the context's ZAP handler (:func:`address_gate`) about
    every peer of ``sock``, NULL mechanism included."""
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
