"""Leg building: pure functions from the client's body to each leg's body.

Producer leg: the client's body with ``stream: false``, ``max_tokens: 1`` (added if absent),
``max_completion_tokens: 1`` if present, the dialect's ``kv_transfer_params``, and the fields
that only shape the answer removed (:data:`PRODUCER_REMOVED_FIELDS`): ``stream_options``,
``min_tokens``, ``min_completion_tokens`` (a one-token leg), ``echo``, ``logprobs``,
``top_logprobs``, ``n``, ``best_of`` (work on an answer nobody reads; ``top_logprobs`` goes with
``logprobs`` because chat engines refuse one without the other).

Consumer leg: the client's body with only ``kv_transfer_params`` set (NIXL: the producer's
returned object verbatim; P2P: ``remote_prefiller`` built from the producer's answer), spliced
into the client's bytes (:func:`consumer_body`), or the client's raw bytes unchanged when there
is nothing to set (aggregated backends, fallback).

Every other field is left exactly as the client sent it: nothing is re-typed or defaulted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NewType

import orjson

from pdproxy.errors import KvAddressMismatch, LegFailed
from pdproxy.front.intake import ClientBody
from pdproxy.request.record import REQUEST_ID_HEADER, LegKind, RequestId, leg_request_id
from pdproxy.routing.base import PullSource
from pdproxy.settings import Dialect

KvRequestId = NewType("KvRequestId", str)

PRODUCER_REMOVED_FIELDS = (
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
    "echo",
    "logprobs",
    "top_logprobs",
    "n",
    "best_of",
)


def new_kv_request_id() -> KvRequestId:
    """A fresh 128-bit random id naming one producer supply (P2P dialect)."""
    return KvRequestId(os.urandom(16).hex())


def producer_kv_params(dialect: Dialect, kv_request_id: KvRequestId) -> dict[str, Any]:
    if dialect is Dialect.NIXL:
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
    if dialect is Dialect.P2P:
        return {"remote_decoder": {"kv_request_id": kv_request_id}}
    raise ValueError(f"dialect {dialect} has no producer leg")


def producer_body(body: ClientBody, kv_params: Mapping[str, Any]) -> bytes:
    data = dict(body.data)
    data["stream"] = False
    data["max_tokens"] = 1
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    for name in PRODUCER_REMOVED_FIELDS:
        data.pop(name, None)
    data["kv_transfer_params"] = kv_params
    return body.encode(data)


_JSON_SPACE = b" \t\n\r"


def consumer_body(body: ClientBody, kv_params: Mapping[str, Any] | None) -> bytes:
    """The client's bytes with ``kv_transfer_params`` spliced in before the object's closing
    brace: no copy of the parsed body and no re-encoding of it on every request, and every
    other byte exactly as the client sent it. Re-encoded instead when the bytes cannot take a
    plain splice (a leading BOM, the key already present, params orjson cannot write)."""
    if kv_params is None:
        return body.raw
    raw = body.raw.rstrip(_JSON_SPACE)
    if raw[-1:] == b"}" and raw[:1] != b"\xef" and "kv_transfer_params" not in body.data:
        try:
            encoded = orjson.dumps(kv_params)
        except orjson.JSONEncodeError:
            pass  # nested deeper than orjson writes: the codec's fallback below
        else:
            member = b'"kv_transfer_params":' + encoded
            return raw[:-1] + (b"," + member + b"}" if body.data else member + b"}")
    data = dict(body.data)
    data["kv_transfer_params"] = kv_params
    return body.encode(data)


MAX_ENGINE_ID_CHARS = 256
"""The workers' own cap on ids in ``kv_transfer_params``: a longer one would be refused there."""


def consumer_kv_params(
    dialect: Dialect,
    producer: str,
    answer: bytes,
    kv_request_id: KvRequestId,
    kv_address: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Build the consumer's ``kv_transfer_params`` from the producer's JSON answer.

    Raises :class:`LegFailed` when the answer lacks what the dialect needs, and
    :class:`KvAddressMismatch` when ``kv_address`` (the producer's configured one) is given and
    the answer's ``remote_host``/``remote_port`` differ: the producer leg then counts as failed
    (retry elsewhere or fall back to the consumer alone).
    """
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError as exc:
        raise LegFailed(producer, "producer answer is not JSON") from exc
    kvp = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if not isinstance(kvp, dict):
        raise LegFailed(producer, "producer answer has no kv_transfer_params object")
    if kv_address is not None:
        _check_address(producer, kvp, kv_address)
    if dialect is Dialect.NIXL:
        return kvp
    if dialect is Dialect.P2P:
        host, port = kvp.get("remote_host"), kvp.get("remote_port")
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            raise LegFailed(producer, "producer answer lacks remote_host/remote_port")
        answered_id = kvp.get("kv_request_id", kv_request_id)
        if answered_id != kv_request_id:
            raise LegFailed(producer, "producer answered a different kv_request_id")
        prefiller: dict[str, Any] = {
            "kv_request_id": kv_request_id,
            "remote_host": host,
            "remote_port": port,
        }
        # The producer's node id lets the consumer's P2P handshake refuse any other node (a relay
        # or a host that took over the address); a producer that names none is not pinned.
        engine_id = kvp.get("remote_engine_id")
        if engine_id is not None:
            if not isinstance(engine_id, str) or not 0 < len(engine_id) <= MAX_ENGINE_ID_CHARS:
                raise LegFailed(producer, "producer answer has an unusable remote_engine_id")
            prefiller["remote_engine_id"] = engine_id
        return {"remote_prefiller": prefiller}
    raise ValueError(f"dialect {dialect} has no consumer kv_transfer_params")


def kv_peer_of(kv_params: Mapping[str, Any]) -> str | None:
    """The KV address (``host:port``, or the host alone) a consumer leg's params name: NIXL's
    ``remote_host``/``remote_port`` at the top, P2P's inside ``remote_prefiller``."""
    inner = kv_params.get("remote_prefiller")
    kvp = inner if isinstance(inner, Mapping) else kv_params
    host, port = kvp.get("remote_host"), kvp.get("remote_port")
    if not isinstance(host, str) or not host:
        return None
    return f"{host}:{port}" if isinstance(port, int) else host


def _check_address(producer: str, kvp: Mapping[str, Any], expected: tuple[str, int]) -> None:
    host, port = kvp.get("remote_host"), kvp.get("remote_port")
    named = host.strip("[]").lower() if isinstance(host, str) else None
    if named != expected[0].lower() or port != expected[1] or isinstance(port, bool):
        raise KvAddressMismatch(
            producer, f"producer named KV address {host!r}:{port!r}, not its configured one"
        )


def with_kv_source(params: Mapping[str, Any] | None, source: PullSource) -> dict[str, Any]:
    """``params`` (a p2p producer leg's, or none for a consumer alone) plus
    ``remote_kv_source``: the leg's node pulls the prompt's prefix from ``source``'s P2P
    server before computing the rest. The address is the holder's configured ``kv_address``."""
    kv_source: dict[str, Any] = {"remote_host": source.host, "remote_port": source.port}
    if source.engine_id is not None:
        kv_source["remote_engine_id"] = source.engine_id
    return {**(params or {}), "remote_kv_source": kv_source}


def leg_headers(
    base: dict[str, str],
    request_id: RequestId,
    leg: LegKind,
    attempt: int,
    auth_header: str | None,
) -> dict[str, str]:
    """``base`` (content type, validated trace headers) plus this leg's own id
    (:func:`~pdproxy.request.record.leg_request_id`) and the backend's key."""
    out = dict(base)
    out[REQUEST_ID_HEADER] = leg_request_id(request_id, leg, attempt)
    if auth_header is not None:
        out["authorization"] = auth_header
    return out
