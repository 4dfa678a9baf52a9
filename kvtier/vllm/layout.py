"""The P2P layout fingerprint of a vLLM engine, as both connector sides compute it.

The worker side sees the KV-cache tensors; the scheduler side (which offers blocks for
``remote_kv_source`` legs and so must complete a P2P handshake too) sees only vLLM's
``KVCacheConfig``. Both must agree, or a holder refuses the scheduler's handshake:
:func:`fingerprint_from_config` is the scheduler's, :func:`fingerprint_from_layers` the
worker's, and the worker checks that they match when the KV cache is registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.p2p.layout import LayoutFingerprint

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def fingerprint_from_layers(
    hash_seed: str, block_size: int, layers: Sequence[torch.Tensor]
) -> LayoutFingerprint:
    """One page is one block of every layer, back to back (:mod:`kvtier.vllm.copies`)."""
    block_nbytes = layers[0].numel() // layers[0].shape[0] * layers[0].element_size()
    return LayoutFingerprint(
        hash_seed, block_size, str(layers[0].dtype), (block_nbytes * len(layers),)
    )


def fingerprint_from_config(
    hash_seed: str, block_size: int, kv_cache_config: KVCacheConfig
) -> LayoutFingerprint:
    """The same fingerprint from the single KV-cache group's spec (scheduler side)."""
    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    block_nbytes = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
    dtype = spec.dtype
    return LayoutFingerprint(
        hash_seed, block_size, str(dtype), (block_nbytes * len(group.layer_names),)
    )
