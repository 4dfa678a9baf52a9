"""``sim``: a backend with no arithmetic whose output still depends on the KV it reads.

A full block's page is a deterministic function of its block hash and layer; a partial block's
rows are a function of the parent hash, the block's tokens so far and the layer. The next token
is a hash of every page byte the step reads (all blocks for the full-attention group, the
window's blocks for the sliding-window group), so a wrong or missing page changes the text.
Latency follows a configurable model: seconds per prefill token and per decode step. A LoRA
adapter's key enters partial rows and every digest, so each adapter writes and reads its own KV
and its text differs from the base model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from kvtier.keys import BlockHash, encode_tokens
from kvtier.worker.backends.base import NO_PAGE, StepInput
from kvtier.worker.kv_layout import KVGroupSpec, first_attended_position
from kvtier.worker.page_pool import PagePool

_PRINTABLE_FIRST = 32
_PRINTABLE_COUNT = 95
_NEG = -1.0e9


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Shape and latency model of the sim backend."""

    layers_per_group: int = 2
    row_bytes: int = 16
    sliding_window: int = 64
    prefill_s_per_token: float = 0.0
    decode_s_per_step: float = 0.0


def _expand(seed: bytes, nbytes: int) -> bytes:
    """``nbytes`` deterministic bytes from ``seed`` (xxh3_128 in counter mode)."""
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += xxhash.xxh3_128_digest(seed + counter.to_bytes(4, "little"))
        counter += 1
    return bytes(out[:nbytes])


class SimBackend:
    """Implements :class:`~kvtier.worker.backends.base.ComputeBackend` without a model."""

    name = "sim"

    def __init__(self, config: SimConfig, block_size: int, root: BlockHash) -> None:
        self.config = config
        self.block_size = block_size
        self.vocab_size = 257
        self.eos_token_id: int | None = None
        self._root = root
        n = config.layers_per_group
        page = (n, block_size, config.row_bytes)
        self.groups: tuple[KVGroupSpec, ...] = (
            KVGroupSpec(0, tuple(range(n)), None, page, torch.uint8),
            KVGroupSpec(1, tuple(range(n, 2 * n)), config.sliding_window, page, torch.uint8),
        )

    def modeled_latency_s(self, prefill_tokens: int, decode_sequences: int) -> float:
        c = self.config
        return prefill_tokens * c.prefill_s_per_token + (
            c.decode_s_per_step if decode_sequences else 0.0
        )

    def full_page(self, block_hash: BlockHash, group: KVGroupSpec) -> torch.Tensor:
        """The page of a full block in ``group``: a function of the hash and each layer."""
        per_layer = self.block_size * self.config.row_bytes
        data = b"".join(
            _expand(block_hash + layer.to_bytes(2, "little"), per_layer) for layer in group.layers
        )
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(group.page_shape)

    def _row(self, parent: bytes, prefix: bytes, layer: int, lora_key: bytes) -> bytes:
        return _expand(
            parent + prefix + b"\x00row" + layer.to_bytes(2, "little") + lora_key,
            self.config.row_bytes,
        )

    def _write(self, seq: StepInput, pools: Sequence[PagePool]) -> None:
        bs = self.block_size
        for block in range(seq.start // bs, (seq.end + bs - 1) // bs):
            full = (block + 1) * bs <= seq.end and block < len(seq.block_hashes)
            for pool in pools:
                page = seq.page_tables[pool.spec.index][block]
                if page == NO_PAGE:
                    continue
                if full:
                    pool.storage[page] = self.full_page(seq.block_hashes[block], pool.spec)
                    continue
                parent = self._root if block == 0 else seq.block_hashes[block - 1]
                lo = max(seq.start, block * bs)
                for p in range(lo, min(seq.end, (block + 1) * bs)):
                    prefix = encode_tokens(seq.token_ids[block * bs : p + 1])
                    for li, layer in enumerate(pool.spec.layers):
                        row = self._row(parent, prefix, layer, seq.lora_key)
                        pool.storage[page, li, p - block * bs] = torch.frombuffer(
                            bytearray(row), dtype=torch.uint8
                        )

    def _read_digest(self, seq: StepInput, pools: Sequence[PagePool]) -> int:
        bs = self.block_size
        digest = xxhash.xxh3_64(seq.lora_key)
        last = seq.end - 1
        for pool in pools:
            table = seq.page_tables[pool.spec.index]
            b0 = first_attended_position(last, pool.spec.sliding_window) // bs
            n_full = seq.end // bs
            if n_full > b0:
                pages = torch.tensor(list(table[b0:n_full]), dtype=torch.long)
                digest.update(pool.storage[pages].cpu().numpy().tobytes())
            tail = seq.end % bs
            if tail:
                rows = pool.storage[table[n_full], :, :tail].contiguous()
                digest.update(rows.cpu().numpy().tobytes())
        return digest.intdigest()

    def forward(self, batch: Sequence[StepInput], pools: Sequence[PagePool]) -> torch.Tensor:
        logits = torch.full((len(batch), self.vocab_size), _NEG, dtype=torch.float64)
        for i, seq in enumerate(batch):
            self._write(seq, pools)
            token = _PRINTABLE_FIRST + self._read_digest(seq, pools) % _PRINTABLE_COUNT
            logits[i, token] = 0.0
        return logits
