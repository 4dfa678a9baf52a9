"""The interface every compute backend implements.

A backend declares its KV-cache groups and computes steps: for each sequence in a batch, the KV
of positions ``[start, len(token_ids))`` is written into the sequence's pages (page tables give
one page per block index and group; ``-1`` marks a block whose page this sequence does not hold,
which only a sliding-window group may have outside its window), and the logits of the last
position are returned. Attention reads earlier positions from the pools, never from elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.keys import BlockHash
from kvtier.worker.kv_layout import KVGroupSpec
from kvtier.worker.page_pool import PagePool

NO_PAGE = -1


@dataclass(frozen=True, slots=True)
class StepInput:
    """One sequence's share of a step."""

    token_ids: Sequence[int]
    start: int
    page_tables: Sequence[Sequence[int]]
    block_hashes: Sequence[BlockHash]
    """Hashes of the sequence's full blocks (at least those of ``token_ids``' full blocks)."""
    lora_key: bytes = b""
    """The LoRA adapter the sequence runs under (:attr:`kvtier.worker.lora.LoraAdapter.key`);
    empty for the base model."""

    @property
    def end(self) -> int:
        return len(self.token_ids)


class ComputeBackend(Protocol):
    """A model the engine can run."""

    name: str
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    groups: tuple[KVGroupSpec, ...]

    def forward(self, batch: Sequence[StepInput], pools: Sequence[PagePool]) -> torch.Tensor:
        """Write KV for the new positions and return float logits ``[len(batch), vocab_size]``."""
        ...

    def modeled_latency_s(self, prefill_tokens: int, decode_sequences: int) -> float:
        """Extra wall time the engine waits after a step (a latency model; 0 for real compute)."""
        ...
