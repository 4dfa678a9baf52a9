"""The producer-leg policy: which requests a supplying tier (P2P) takes at REQUEST_LEVEL.

DESIGN §4: ``REQUEST_LEVEL`` exactly for producer legs with a non-empty ``kv_request_id``
(``kv_transfer_params={"remote_decoder": {"kv_request_id": K}}``). Plain requests, consumer legs
(``remote_prefiller``), NIXL-dialect legs and malformed params (``remote_decoder`` without a
usable ``kv_request_id``) stay ``BLOCK_LEVEL``.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.offload.types import OffloadPolicy

PRODUCER_FIELD = "remote_decoder"
CONSUMER_FIELD = "remote_prefiller"
KV_REQUEST_ID_FIELD = "kv_request_id"


def producer_kv_request_id(kv_transfer_params: Mapping[str, object] | None) -> str | None:
    """The ``kv_request_id`` of a producer leg, or ``None`` if this is not a producer leg."""
    if not isinstance(kv_transfer_params, Mapping):
        return None
    decoder = kv_transfer_params.get(PRODUCER_FIELD)
    if not isinstance(decoder, Mapping):
        return None
    kv_request_id = decoder.get(KV_REQUEST_ID_FIELD)
    if not isinstance(kv_request_id, str) or not kv_request_id.strip():
        return None
    return kv_request_id


def producer_leg_policy(kv_transfer_params: Mapping[str, object] | None) -> OffloadPolicy:
    """``REQUEST_LEVEL`` for a producer leg with a ``kv_request_id``, else ``BLOCK_LEVEL``."""
    if producer_kv_request_id(kv_transfer_params) is None:
        return OffloadPolicy.BLOCK_LEVEL
    return OffloadPolicy.REQUEST_LEVEL
