"""Wiring: settings → backend, KV cache and engine."""

from __future__ import annotations

import torch

from kvtier.keys import BlockHasher
from kvtier.worker.backends.base import ComputeBackend
from kvtier.worker.backends.sim import SimBackend, SimConfig
from kvtier.worker.backends.tiny import TinyBackend, TinyConfig
from kvtier.worker.engine import Engine, EngineConfig
from kvtier.worker.kv_cache import BlockStoredListener, KVCache
from kvtier.worker.page_pool import CacheListener
from kvtier.worker.settings import WorkerSettings
from kvtier.worker.stats import EngineStats


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_backend(settings: WorkerSettings, hasher: BlockHasher) -> ComputeBackend:
    device = pick_device(settings.device)
    if settings.model == "tiny":
        config = TinyConfig(
            hidden=settings.tiny_hidden,
            layers=settings.tiny_layers,
            heads=settings.tiny_heads,
            kv_heads=settings.tiny_kv_heads,
            ffn=settings.tiny_ffn,
            sliding_window=settings.sliding_window,
            seed=settings.model_seed,
            dtype=torch.float64 if settings.dtype == "float64" else torch.float32,
        )
        return TinyBackend(config, settings.block_size, device)
    sim = SimConfig(
        sliding_window=settings.sliding_window,
        prefill_s_per_token=settings.sim_prefill_ms_per_token / 1000.0,
        decode_s_per_step=settings.sim_decode_ms_per_step / 1000.0,
    )
    return SimBackend(sim, settings.block_size, hasher.root)


def build_engine(
    settings: WorkerSettings,
    *,
    on_stored: BlockStoredListener | None = None,
    on_removed: CacheListener | None = None,
    stats: EngineStats | None = None,
) -> Engine:
    hasher = BlockHasher(settings.hash_seed, settings.block_size)
    backend = build_backend(settings, hasher)
    kv = KVCache(
        backend.groups,
        settings.block_size,
        settings.num_pages,
        pick_device(settings.device),
        on_stored=on_stored,
        on_removed=on_removed,
    )
    config = EngineConfig(
        max_model_len=settings.max_model_len,
        max_running=settings.max_running,
        max_batched_tokens=settings.max_batched_tokens,
    )
    return Engine(backend, kv, hasher, config, stats)
