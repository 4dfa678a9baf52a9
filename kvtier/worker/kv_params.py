"""``kv_transfer_params`` in both dialects: which leg a request is, and the producer's answer.

P2P dialect (kvtier):
- producer leg ``{"remote_decoder": {"kv_request_id": K}}`` → answer
  ``{"remote_host", "remote_port", "kv_request_id", "num_blocks", "remote_engine_id"}``;
- consumer leg ``{"remote_prefiller": {"kv_request_id", "remote_host", "remote_port"}}``, and
  ``"remote_engine_id"`` from the answer when the proxy passes it on: the consumer then refuses
  to fetch from any other P2P node.

Symmetric pull (vLLM P2P tier's ``remote_kv_source``; :mod:`kvtier.p2p.offer`):
- ``{"remote_kv_source": {"remote_host", "remote_port", "remote_engine_id"?}}`` alone: a
  :class:`PullLeg`, a plain request that first pulls the prefix blocks it lacks from that holder
  (``remote_engine_id``: the holder's P2P node id; the handshake then refuses any other node);
- with ``remote_decoder``: a :class:`ProducerLeg` whose ``source`` is pulled from first; it then
  computes the rest and supplies everything under its ``kv_request_id`` as usual.
- with ``remote_prefiller`` (or the NIXL fields): malformed (a consumer's KV comes from its
  producer).

NIXL-shaped dialect (vLLM NixlConnector, see ``shared/wire``):
- producer leg ``{"do_remote_decode": true, ...}`` → answer ``{"do_remote_prefill": true,
  "do_remote_decode": false, "remote_engine_id", "remote_request_id", "remote_block_ids",
  "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "transfer_mode"}`` with
  ``remote_block_ids`` one list per KV-cache group, as vLLM 0.32 answers (it also sends
  ``remote_num_tokens``, ``remote_blocks_expiry_time``, ``remote_prefill_cached_tokens``);
- consumer leg: that answer, verbatim (extra keys tolerated); the blocks are pulled over kvtier
  P2P from ``remote_host:remote_port`` under ``remote_request_id``, from the node named
  ``remote_engine_id`` (when present).

Anything else that is present but malformed raises :class:`KVTransferParamsError`; the server
then runs the leg locally and counts it. An id or host longer than :data:`MAX_ID_CHARS` raises
:class:`KVTransferRefused` instead (400): ids are kept (supplies, released-id memory, logs), so
their size is bounded before anything keeps them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.worker.errors import KVTransferParamsError, KVTransferRefused

MAX_ID_CHARS = 256
"""Longest ``kv_request_id``, request id or host a caller may send (the proxy's ids are 32 hex
characters, vLLM's about 50, a DNS name at most 253)."""

_SHOWN_CHARS = 64


class Dialect(enum.Enum):
    P2P = "p2p"
    NIXL = "nixl"


@dataclass(frozen=True, slots=True)
class KvSource:
    """A holder to pull prefix blocks from (``remote_kv_source``)."""

    remote_host: str
    remote_port: int
    remote_engine_id: str | None = None
    """The holder's node id (its P2P identity); None when the leg does not say."""


@dataclass(frozen=True, slots=True)
class ProducerLeg:
    """This request computes the prompt's KV and supplies it under ``kv_request_id``."""

    dialect: Dialect
    kv_request_id: str
    source: KvSource | None = None
    """Pull what this node lacks from this holder before computing (``remote_kv_source``)."""


@dataclass(frozen=True, slots=True)
class ConsumerLeg:
    """This request pulls the prompt's KV from a producer, then decodes."""

    dialect: Dialect
    kv_request_id: str
    remote_host: str
    remote_port: int
    num_blocks: int | None = None
    remote_engine_id: str | None = None
    """The producer's node id (its P2P identity); None when the leg does not say."""


@dataclass(frozen=True, slots=True)
class PullLeg:
    """A plain request that pulls the prefix blocks it lacks from ``source`` first."""

    source: KvSource


Leg = ProducerLeg | ConsumerLeg | PullLeg


def pull_source(leg: Leg | None) -> KvSource | None:
    """The holder ``leg`` pulls from first, if any."""
    return leg.source if isinstance(leg, PullLeg | ProducerLeg) else None


def shown(value: object) -> str:
    """A caller's value as errors and logs quote it: short scalars as they are, long strings cut,
    containers by type only (any of them may be megabytes)."""
    if isinstance(value, str):
        if len(value) > _SHOWN_CHARS:
            return f"{value[:_SHOWN_CHARS]!r}... ({len(value)} characters)"
        return repr(value)
    if (
        value is None
        or isinstance(value, bool | float)
        or (isinstance(value, int) and value.bit_length() <= 64)
    ):
        return repr(value)
    return f"a {type(value).__name__}"


def _port(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise KVTransferParamsError(f"{what} must be a TCP port, got {shown(value)}")
    return value


def _text(value: object, what: str) -> str:
    if isinstance(value, str) and len(value) > MAX_ID_CHARS:
        raise KVTransferRefused(
            f"kv_transfer_params: {what} is longer than {MAX_ID_CHARS} characters",
            param="kv_transfer_params",
        )
    if not isinstance(value, str) or not value.strip():
        raise KVTransferParamsError(f"{what} must be a non-empty string, got {shown(value)}")
    if not value.isascii():
        raise KVTransferParamsError(f"{what} must be ASCII, got {shown(value)}")
    return value


def _optional_text(value: object, what: str) -> str | None:
    return None if value is None else _text(value, what)


def parse_leg(params: Mapping[str, object] | None, nixl_request_id: str) -> Leg | None:
    """The leg ``params`` describe (None: a plain request).

    ``nixl_request_id`` names the supply of a NIXL-shaped producer leg (which carries no id).
    """
    if not params:
        return None
    source = _source(params["remote_kv_source"]) if "remote_kv_source" in params else None
    if source is not None and not set(params) <= {"remote_kv_source", "remote_decoder"}:
        raise KVTransferParamsError("remote_kv_source goes alone or with remote_decoder")
    if "remote_decoder" in params:
        decoder = params["remote_decoder"]
        if not isinstance(decoder, Mapping):
            raise KVTransferParamsError("remote_decoder must be an object")
        kv_request_id = _text(decoder.get("kv_request_id"), "kv_request_id")
        return ProducerLeg(Dialect.P2P, kv_request_id, source)
    if source is not None:
        return PullLeg(source)
    if "remote_prefiller" in params:
        pre = params["remote_prefiller"]
        if not isinstance(pre, Mapping):
            raise KVTransferParamsError("remote_prefiller must be an object")
        return ConsumerLeg(
            Dialect.P2P,
            _text(pre.get("kv_request_id"), "kv_request_id"),
            _text(pre.get("remote_host"), "remote_host"),
            _port(pre.get("remote_port"), "remote_port"),
            remote_engine_id=_optional_text(pre.get("remote_engine_id"), "remote_engine_id"),
        )
    if params.get("do_remote_decode") is True:
        return ProducerLeg(Dialect.NIXL, nixl_request_id)
    if params.get("do_remote_prefill") is True:
        block_ids = params.get("remote_block_ids")
        if isinstance(block_ids, list) and block_ids and isinstance(block_ids[0], list):
            block_ids = block_ids[0]  # vLLM 0.32: one id list per KV-cache group
        num_blocks = len(block_ids) if isinstance(block_ids, Sequence) else None
        return ConsumerLeg(
            Dialect.NIXL,
            _text(params.get("remote_request_id"), "remote_request_id"),
            _text(params.get("remote_host"), "remote_host"),
            _port(params.get("remote_port"), "remote_port"),
            num_blocks,
            _optional_text(params.get("remote_engine_id"), "remote_engine_id"),
        )
    if "do_remote_decode" in params or "do_remote_prefill" in params:
        return None  # NIXL fields present, both false: a plain request
    raise KVTransferParamsError(
        f"unrecognised kv_transfer_params keys: {shown(', '.join(sorted(map(str, params))))}"
    )


def _source(value: object) -> KvSource:
    if not isinstance(value, Mapping):
        raise KVTransferParamsError("remote_kv_source must be an object")
    return KvSource(
        _text(value.get("remote_host"), "remote_kv_source.remote_host"),
        _port(value.get("remote_port"), "remote_kv_source.remote_port"),
        _optional_text(value.get("remote_engine_id"), "remote_kv_source.remote_engine_id"),
    )


def producer_answer(
    leg: ProducerLeg,
    *,
    host: str,
    port: int,
    num_blocks: int,
    block_ids: Sequence[int],
    engine_id: str,
) -> dict[str, object]:
    """The ``kv_transfer_params`` a producer leg returns, in the leg's dialect."""
    if leg.dialect is Dialect.P2P:
        return {
            "remote_host": host,
            "remote_port": port,
            "kv_request_id": leg.kv_request_id,
            "num_blocks": num_blocks,
            "remote_engine_id": engine_id,
        }
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": leg.kv_request_id,
        "remote_block_ids": [list(block_ids)],
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "transfer_mode": "pull",
    }
