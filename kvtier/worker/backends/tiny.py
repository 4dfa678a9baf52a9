"""``tiny``: a small Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with seeded random weights.

Even layers use full attention, odd layers a sliding window, so the model has two KV-cache
groups. Generation is masked to printable ASCII, newline and EOS so that its (random) text stays
readable and every token is one character.

Weights and KV are float64 by default: a prompt computed in one pass and the same prompt computed
as cached prefix + tail then agree far below any logit gap, so PD and single-node greedy outputs
are equal token for token.

A LoRA adapter adds a rank-4 delta ``(h A) B`` to the output head, its factors seeded by the
adapter's key: the same adapter gives the same text on every node, another adapter another text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.worker.backends.base import StepInput
from kvtier.worker.kv_layout import KVGroupSpec, first_attended_position
from kvtier.worker.page_pool import PagePool

_LORA_RANK = 4
_LORA_CACHE = 64
BYTE_VOCAB = 256
EOS_TOKEN_ID = 256


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Shape of the tiny model."""

    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    sliding_window: int = 64
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: torch.dtype = torch.float64
    eos_bias: float = -8.0
    """Added to the EOS logit: random weights would otherwise end most answers within a few
    tokens. EOS stays reachable."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(slots=True)
class _Layer:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class TinyBackend:
    """The tiny decoder; implements :class:`~kvtier.worker.backends.base.ComputeBackend`."""

    name = "tiny"

    def __init__(self, config: TinyConfig, block_size: int, device: torch.device) -> None:
        if config.hidden % config.heads or config.heads % config.kv_heads:
            raise ValueError("hidden must divide by heads and heads by kv_heads")
        self.config = config
        self.block_size = block_size
        self.device = device
        self.vocab_size = BYTE_VOCAB + 1
        self._lora: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.eos_token_id: int | None = EOS_TOKEN_ID
        full = tuple(i for i in range(config.layers) if i % 2 == 0)
        swa = tuple(i for i in range(config.layers) if i % 2 == 1)
        page = (2, block_size, config.kv_heads, config.head_dim)
        specs = [KVGroupSpec(0, full, None, (len(full), *page), config.dtype)]
        if swa:
            specs.append(
                KVGroupSpec(1, swa, config.sliding_window, (len(swa), *page), config.dtype)
            )
        self.groups = tuple(specs)
        self._layer_slot = {
            layer: (g.index, g.layers.index(layer)) for g in specs for layer in g.layers
        }
        self._init_weights()

    def _init_weights(self) -> None:
        c = self.config
        gen = torch.Generator().manual_seed(c.seed)

        def mat(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(cols)
            return w.to(self.device, c.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, dtype=c.dtype, device=self.device)

        self.embed = torch.randn(self.vocab_size, c.hidden, generator=gen, dtype=torch.float64)
        self.embed = self.embed.to(self.device, c.dtype)
        hd = c.head_dim
        self.layers = [
            _Layer(
                attn_norm=ones(c.hidden),
                wq=mat(c.heads * hd, c.hidden),
                wk=mat(c.kv_heads * hd, c.hidden),
                wv=mat(c.kv_heads * hd, c.hidden),
                wo=mat(c.hidden, c.heads * hd),
                mlp_norm=ones(c.hidden),
                w_gate=mat(c.ffn, c.hidden),
                w_up=mat(c.ffn, c.hidden),
                w_down=mat(c.hidden, c.ffn),
            )
            for _ in range(c.layers)
        ]
        self.final_norm = ones(c.hidden)
        self.lm_head = mat(self.vocab_size, c.hidden) * 4.0
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[32:127] = True
        allowed[10] = True
        allowed[EOS_TOKEN_ID] = True
        self._generation_mask = ~allowed
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        self._inv_freq = inv.to(self.device)

    def modeled_latency_s(self, prefill_tokens: int, decode_sequences: int) -> float:
        return 0.0

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, head_dim]; rotate pairs (first half, second half).
        ang = positions.to(torch.float64)[:, None] * self._inv_freq[None, :]
        cos = ang.cos().to(x.dtype)[:, None, :]
        sin = ang.sin().to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    @torch.inference_mode()
    def forward(self, batch: Sequence[StepInput], pools: Sequence[PagePool]) -> torch.Tensor:
        c = self.config
        hd = c.head_dim
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        spans: list[tuple[int, int]] = []
        for seq in batch:
            lo = len(tokens)
            tokens.extend(seq.token_ids[seq.start : seq.end])
            positions.extend(range(seq.start, seq.end))
            spans.append((lo, len(tokens)))
        tok = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        x = self.embed[tok]
        for layer_index, layer in enumerate(self.layers):
            group_index, slot = self._layer_slot[layer_index]
            pool = pools[group_index]
            window = pool.spec.sliding_window
            h = self._rms_norm(x, layer.attn_norm)
            q = self._rope((h @ layer.wq.T).view(-1, c.heads, hd), pos)
            k = self._rope((h @ layer.wk.T).view(-1, c.kv_heads, hd), pos)
            v = (h @ layer.wv.T).view(-1, c.kv_heads, hd)
            outs = []
            for seq, (lo, hi) in zip(batch, spans, strict=True):
                table = seq.page_tables[group_index]
                seq_pos = pos[lo:hi]
                pages = torch.tensor(
                    [table[p // bs] for p in range(seq.start, seq.end)], device=self.device
                )
                slots = seq_pos % bs
                pool.storage[pages, slot, 0, slots] = k[lo:hi]
                pool.storage[pages, slot, 1, slots] = v[lo:hi]
                outs.append(self._attend(q[lo:hi], seq, pool, slot, window))
            attn = torch.cat(outs, dim=0).reshape(-1, c.heads * hd)
            x = x + attn @ layer.wo.T
            h = self._rms_norm(x, layer.mlp_norm)
            x = x + (F.silu(h @ layer.w_gate.T) * (h @ layer.w_up.T)) @ layer.w_down.T
        last = torch.tensor([hi - 1 for _, hi in spans], dtype=torch.long, device=self.device)
        h = self._rms_norm(x[last], self.final_norm)
        logits = h @ self.lm_head.T
        for i, seq in enumerate(batch):
            if seq.lora_key:
                a, b = self._lora_factors(seq.lora_key)
                logits[i] += (h[i] @ a) @ b
        logits = logits.to(torch.float64).cpu()
        logits[:, EOS_TOKEN_ID] += self.config.eos_bias
        return logits.masked_fill(self._generation_mask, float("-inf"))

    def _lora_factors(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        factors = self._lora.get(key)
        if factors is None:
            gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
            hidden, vocab = self.lm_head.shape[1], self.lm_head.shape[0]
            a = torch.randn(hidden, _LORA_RANK, generator=gen, dtype=torch.float64)
            b = torch.randn(_LORA_RANK, vocab, generator=gen, dtype=torch.float64)
            scale = 2.0 / math.sqrt(hidden)
            factors = (a.to(self.lm_head) * scale, b.to(self.lm_head))
            if len(self._lora) >= _LORA_CACHE:  # adapters come and go: keep the newest
                del self._lora[next(iter(self._lora))]
            self._lora[key] = factors
        return factors

    def _attend(
        self, q: torch.Tensor, seq: StepInput, pool: PagePool, slot: int, window: int | None
    ) -> torch.Tensor:
        c = self.config
        bs = self.block_size
        first_pos = first_attended_position(seq.start, window)
        b0, b1 = first_pos // bs, (seq.end + bs - 1) // bs
        table = seq.page_tables[pool.spec.index]
        pages = torch.tensor(list(table[b0:b1]), dtype=torch.long, device=self.device)
        kv = pool.storage[pages, slot]  # [nb, 2, bs, kvh, hd]
        keys = kv[:, 0].reshape(-1, c.kv_heads, c.head_dim)[: seq.end - b0 * bs]
        vals = kv[:, 1].reshape(-1, c.kv_heads, c.head_dim)[: seq.end - b0 * bs]
        rep = c.heads // c.kv_heads
        keys = keys.repeat_interleave(rep, dim=1)
        vals = vals.repeat_interleave(rep, dim=1)
        q_pos = torch.arange(seq.start, seq.end, device=self.device)[:, None]
        k_pos = torch.arange(b0 * bs, seq.end, device=self.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=allowed
        )
        return out.transpose(0, 1)
