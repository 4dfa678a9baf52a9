"""vLLM KV blocks ↔ kvtier host pages: a page is one block of every layer, back to back, and a
round trip through host pages puts every byte where it came from (no vLLM needed: the copier
only sees vLLM's per-layer tensors, block-major as vLLM's CPU backend lays them out)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.pages import HostPages
from kvtier.vllm.copies import LayeredBlockCopier

NUM_BLOCKS = 12


def _layers(num_layers: int, dtype: torch.dtype) -> list[torch.Tensor]:
    # vLLM CPU: [num_blocks, kv_heads, block_size, K|V head_dim], one tensor per layer.
    gen = torch.Generator().manual_seed(num_layers)
    return [torch.randn((NUM_BLOCKS, 2, 4, 8), generator=gen).to(dtype) for _ in range(num_layers)]


@settings(max_examples=40, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]),
    picks=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=6, unique=True),
    data=st.data(),
)
def test_round_trip_moves_whole_blocks(
    num_layers: int, dtype: torch.dtype, picks: list[int], data: st.DataObject
) -> None:
    src = _layers(num_layers, dtype)
    block_nbytes = src[0][0].numel() * src[0].element_size()
    slack = data.draw(st.sampled_from([0, 2, 16]))  # pages may be larger, of any size
    host = HostPages(8, block_nbytes * num_layers + slack, pin=False)
    pages = data.draw(st.permutations(range(8)))[: len(picks)]
    LayeredBlockCopier(src, host).to_host(picks, pages)
    for page, block in zip(pages, picks, strict=True):
        row = host.tensor[page]
        for i, layer in enumerate(src):
            want = layer[block].contiguous().view(torch.uint8).flatten()
            assert torch.equal(row[i * block_nbytes : (i + 1) * block_nbytes], want)

    dst = [torch.zeros_like(t) for t in src]
    targets = data.draw(st.permutations(range(NUM_BLOCKS)))[: len(picks)]
    LayeredBlockCopier(dst, host).to_device(pages, targets)
    for block, target in zip(picks, targets, strict=True):
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(a[block], b[target])
    untouched = set(range(NUM_BLOCKS)) - set(targets)
    assert all(not d[b].any() for d in dst for b in untouched)


def test_layout_it_cannot_copy_is_refused() -> None:
    host = HostPages(2, 64, pin=False)
    with pytest.raises(ValueError, match="exceeds a host page"):
        LayeredBlockCopier(_layers(2, torch.float32), host)
    with pytest.raises(ValueError, match="contiguous"):
        LayeredBlockCopier([torch.zeros((4, 2, 2)).transpose(0, 1)], HostPages(2, 4096, pin=False))
    with pytest.raises(ValueError, match="no KV layers"):
        LayeredBlockCopier([], host)
