"""Worker announcements: the registration message a worker sends the proxy, in vLLM's format.

vLLM's P2pNcclConnector (``P2pNcclEngine.ping``) connects a ZMQ DEALER, whose routing id is its
own ``zmq_address``, to the proxy's ROUTER and sends one frame every 3 s: a msgpack map
``{"type": "P" | "D", "http_address": "host:port", "zmq_address": "host:port"}``. vLLM's
example proxy (``disagg_proxy_p2p_nccl_xpyd.py``) forgets an instance 5 s after its last
message. kvtier keeps that message as it is and adds optional keys, which vLLM's proxy ignores:

- ``"type": "PD"``: one worker serving both legs;
- ``"name"``: the backend name (default: from ``http_address``);
- ``"models"``: the model names it serves;
- ``"dialect"``: ``nixl``, ``p2p`` or ``none`` (default: the proxy's setting);
- ``"events_endpoint"`` / ``"events_replay_endpoint"``: its KV event sockets (``tcp://h:p``);
- ``"leaving": true``: it is shutting down; drain it now rather than at the heartbeat timeout.
- ``"dp_size"``: its data-parallel ranks behind the one HTTP address (the key vLLM's MoRIIO
  connector sends), 1 to :data:`MAX_DP_SIZE`; rank ``r`` serves P2P at ``zmq_address``'s port
  + ``r`` and publishes events at the endpoints' port + ``r``.

For a producer, ``zmq_address`` is where its KV is fetched (kvtier's P2P server, vLLM's NCCL
side channel), so the proxy checks producers' answers against it (``kv_address``). Other vLLM
senders use the same message with more keys: the MoRIIO connector adds ``dp_size``,
``tp_size`` and ``transfer_mode`` and packs several ports into ``zmq_address``
(``host:H,handshake:P,notify:Q``). Unknown keys are ignored (at most :data:`MAX_KEYS` in all),
and a ``zmq_address`` that is not ``host:port`` is kept as opaque text: never connected to,
never a ``kv_address``.

:func:`decode` reads untrusted bytes: it bounds the size before unpacking, accepts only the
keys above with their types and sizes, and names the bad field, never its value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from kvtier.errors import AnnouncementError

MAX_MESSAGE_BYTES = 4096
"""An announcement is a few hundred bytes; nothing larger is unpacked."""
MAX_MODELS = 32
MAX_KEYS = 16
MAX_TEXT_CHARS = 255
MAX_DP_SIZE = 64
"""Most data-parallel ranks one announcement may declare (each is a routing node)."""
"""An address, endpoint, name or model name."""
HEARTBEAT_S = 3.0
"""vLLM's ping interval."""

Kind = Literal["P", "D", "PD"]
_KINDS: dict[str, Kind] = {"P": "P", "D": "D", "PD": "PD"}
_DIALECTS: frozenset[str] = frozenset({"nixl", "p2p", "none"})
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HOST_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252})$")
_TEXT_KEYS = ("name", "dialect", "events_endpoint", "events_replay_endpoint", "zmq_address")


@dataclass(frozen=True, slots=True)
class Announcement:
    kind: Kind
    http_address: str
    """``host:port`` of its OpenAI API (IPv6 hosts in brackets)."""
    zmq_address: str | None = None
    name: str | None = None
    models: tuple[str, ...] = ()
    dialect: str | None = None
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    leaving: bool = False
    dp_size: int = 1

    @property
    def kv_address(self) -> str | None:
        """``zmq_address`` when it is one ``host:port`` (else None: opaque to the proxy)."""
        if not self.zmq_address:
            return None
        try:
            split_host_port(self.zmq_address)
        except AnnouncementError:
            return None
        return self.zmq_address

    def hosts(self) -> list[str]:
        """Every host this announcement would make the proxy connect to (brackets removed)."""
        hosts = [split_host_port(self.http_address)[0]]
        if self.kv_address:
            hosts.append(split_host_port(self.kv_address)[0])
        for endpoint in (self.events_endpoint, self.events_replay_endpoint):
            if endpoint:
                hosts.append(split_host_port(endpoint.removeprefix("tcp://"))[0])
        return hosts


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host without brackets, port); raises
    :class:`AnnouncementError` for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not _HOST_RE.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise AnnouncementError("an address is not host:port")
    return host.strip("[]"), int(port)


def encode(announcement: Announcement) -> bytes:
    data: dict[str, Any] = {"type": announcement.kind, "http_address": announcement.http_address}
    if announcement.zmq_address is not None:
        data["zmq_address"] = announcement.zmq_address
    for key in ("name", "dialect", "events_endpoint", "events_replay_endpoint"):
        value = getattr(announcement, key)
        if value is not None:
            data[key] = value
    if announcement.models:
        data["models"] = list(announcement.models)
    if announcement.leaving:
        data["leaving"] = True
    if announcement.dp_size != 1:
        data["dp_size"] = announcement.dp_size
    payload: bytes = msgpack.packb(data)
    if len(payload) > MAX_MESSAGE_BYTES:
        raise AnnouncementError(f"announcement over {MAX_MESSAGE_BYTES} bytes")
    return payload


def decode(payload: bytes) -> Announcement:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise AnnouncementError(f"announcement over {MAX_MESSAGE_BYTES} bytes")
    try:
        data = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_array_len=MAX_MODELS,
            max_map_len=MAX_KEYS, max_str_len=MAX_TEXT_CHARS, max_bin_len=0, max_ext_len=0,
        )  # fmt: skip
    except (ValueError, msgpack.UnpackException) as exc:
        raise AnnouncementError("announcement is not a msgpack map within the limits") from exc
    if not isinstance(data, dict):
        raise AnnouncementError("announcement is not a map")
    raw_kind = data.get("type")
    kind = _KINDS.get(raw_kind) if isinstance(raw_kind, str) else None
    if kind is None:
        raise AnnouncementError("type must be P, D or PD")
    text = {key: _text(data, key) for key in ("http_address", *_TEXT_KEYS)}
    http_address = text["http_address"]
    if http_address is None:
        raise AnnouncementError("http_address is missing")
    split_host_port(http_address)
    if text["name"] is not None and not _NAME_RE.match(text["name"]):
        raise AnnouncementError(f"name must match {_NAME_RE.pattern}")
    if text["dialect"] is not None and text["dialect"] not in _DIALECTS:
        raise AnnouncementError("dialect must be nixl, p2p or none")
    for key in ("events_endpoint", "events_replay_endpoint"):
        endpoint = text[key]
        if endpoint is not None:
            if not endpoint.startswith("tcp://"):
                raise AnnouncementError(f"{key} must be tcp://host:port")
            split_host_port(endpoint.removeprefix("tcp://"))
    models = data.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise AnnouncementError("models must be a list of names")
    leaving = data.get("leaving", False)
    if not isinstance(leaving, bool):
        raise AnnouncementError("leaving must be a boolean")
    dp_size = data.get("dp_size", 1)
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or not 0 < dp_size <= MAX_DP_SIZE:
        raise AnnouncementError(f"dp_size must be an integer in [1, {MAX_DP_SIZE}]")
    ranked_ports = [
        text["zmq_address"] or "",
        *(text[k] or "" for k in ("events_endpoint", "events_replay_endpoint")),
    ]
    for address in ranked_ports:
        port = address.rpartition(":")[2]
        if port.isascii() and port.isdigit() and int(port) + dp_size - 1 > 65535:
            raise AnnouncementError("dp_size ranks would use ports past 65535")
    return Announcement(
        kind=kind,
        http_address=http_address,
        zmq_address=text["zmq_address"] or None,
        name=text["name"],
        models=tuple(dict.fromkeys(models)),
        dialect=text["dialect"],
        events_endpoint=text["events_endpoint"],
        events_replay_endpoint=text["events_replay_endpoint"],
        leaving=leaving,
        dp_size=dp_size,
    )


def _text(data: dict[str, Any], key: str) -> str | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise AnnouncementError(f"{key} must be a string")
    return value
