"""Copies between vLLM's per-layer KV tensors and kvtier host pages (one page per block).

vLLM registers one tensor per attention layer, block-major (``[num_blocks, ...]``, contiguous per
layer; the layers of a group live at a fixed stride in one allocation). A kvtier host page holds
one block of *every* layer of the group back to back, so a page is a whole block of the model:
``page = layer0[block] ‖ layer1[block] ‖ ...``. One batched gather/scatter per layer and
direction, never one copy per block.

Both directions are synchronous: on return the bytes are where they belong. The caller (the
engine thread, between forward passes) guarantees that no forward pass writes the source blocks
of a save or reads the destination blocks of a load meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.pages import HostPages


def _word_dtype(*nbytes: int) -> torch.dtype:
    """The widest integer type dividing every size: wide elements copy several times faster."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(n % size == 0 for n in nbytes):
            return dtype
    return torch.uint8


class LayeredBlockCopier:
    """Copies whole blocks (all layers) between vLLM's KV tensors and host pages."""

    def __init__(self, layers: Sequence[torch.Tensor], host: HostPages) -> None:
        if not layers:
            raise ValueError("no KV layers to copy")
        views = []
        for layer in layers:
            if not layer.is_contiguous():
                raise ValueError("each layer's KV tensor must be contiguous and block-major")
            views.append(layer.view(layer.shape[0], -1).view(torch.uint8))
        block_nbytes = int(views[0].shape[1])
        if any(int(v.shape[1]) != block_nbytes for v in views):
            raise ValueError("every layer of a group must have the same block size in bytes")
        self.block_nbytes = block_nbytes
        self.page_nbytes = block_nbytes * len(views)
        if self.page_nbytes > host.page_nbytes:
            raise ValueError(f"a block of {self.page_nbytes} bytes exceeds a host page")
        word = _word_dtype(block_nbytes, host.page_nbytes)
        self._layers = [v.view(word) for v in views]  # [num_blocks, block_words] each
        words = self._layers[0].shape[1]
        used = host.tensor.view(word)[:, : words * len(views)]
        self._host = used.view(host.num_pages, len(views), words)  # [pages, layers, words]
        self._device = views[0].device

    def to_host(self, block_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Copy vLLM blocks ``block_ids`` into host pages ``pages`` (same order)."""
        if not block_ids:
            return
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        dest = torch.tensor(pages, dtype=torch.long)
        for i, layer in enumerate(self._layers):
            self._host[:, i].index_copy_(0, dest, layer.index_select(0, blocks).cpu())

    def to_device(self, pages: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy host pages ``pages`` into vLLM blocks ``block_ids`` (same order)."""
        if not block_ids:
            return
        blocks = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        src = torch.tensor(pages, dtype=torch.long)
        for i, layer in enumerate(self._layers):
            layer.index_copy_(0, blocks, self._host[:, i].index_select(0, src).to(self._device))
