"""Page memory: device page pools (KV blocks on ``cuda`` or CPU) and host pages (pinned on CUDA).

- :class:`DevicePages`: a block-major KV tensor ``[num_blocks, ...]`` of any dtype, seen as
  ``num_blocks`` rows of ``block_nbytes`` bytes for copies. A worker keeps one per KV-cache group.
- :class:`HostPages`: ``num_pages`` pages of ``page_nbytes`` bytes in one contiguous uint8 tensor,
  pinned when CUDA is present. Implements ``kvtier.offload.pool.PageBuffer``: ``page_view(i)`` is
  a zero-copy memoryview (for ``sock_recv_into``/``sock_sendall``).
"""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """``cuda`` when available, else ``cpu``."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DevicePages:
    """A block-major KV tensor seen as rows of bytes (one row per block)."""

    __slots__ = ("_bytes", "_tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dim() < 1 or not tensor.is_contiguous():
            raise ValueError("device pages need a contiguous, block-major tensor [num_blocks, ...]")
        self._tensor = tensor
        self._bytes = tensor.reshape(tensor.shape[0], -1).view(torch.uint8)

    @classmethod
    def allocate(
        cls,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> DevicePages:
        """Zero-filled ``[num_blocks, *block_shape]`` on ``device`` (default: cuda if present)."""
        dev = default_device() if device is None else device
        return cls(torch.zeros((num_blocks, *block_shape), dtype=dtype, device=dev))

    @property
    def tensor(self) -> torch.Tensor:
        """The KV tensor itself, ``[num_blocks, ...]`` (the engine computes on it)."""
        return self._tensor

    @property
    def block_bytes(self) -> torch.Tensor:
        """The same memory as ``[num_blocks, block_nbytes]`` uint8."""
        return self._bytes

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    @property
    def num_blocks(self) -> int:
        return int(self._bytes.shape[0])

    @property
    def block_nbytes(self) -> int:
        return int(self._bytes.shape[1])


class HostPages:
    """Host pages in one contiguous uint8 tensor; a ``PageBuffer`` for ``HostPagePool``."""

    __slots__ = ("_flat_view", "_tensor")

    def __init__(self, num_pages: int, page_nbytes: int, *, pin: bool | None = None) -> None:
        if num_pages <= 0 or page_nbytes <= 0:
            raise ValueError(f"need positive sizes, got {num_pages} pages of {page_nbytes} bytes")
        pinned = torch.cuda.is_available() if pin is None else pin
        self._tensor = torch.zeros((num_pages, page_nbytes), dtype=torch.uint8, pin_memory=pinned)
        self._flat_view = self._tensor.numpy().data.cast("B")

    @property
    def tensor(self) -> torch.Tensor:
        """``[num_pages, page_nbytes]`` uint8 (pinned when CUDA is present)."""
        return self._tensor

    @property
    def pinned(self) -> bool:
        return bool(self._tensor.is_pinned())

    @property
    def num_pages(self) -> int:
        return int(self._tensor.shape[0])

    @property
    def page_nbytes(self) -> int:
        return int(self._tensor.shape[1])

    def page_view(self, index: int) -> memoryview:
        """Writable zero-copy view of page ``index``."""
        if not 0 <= index < self.num_pages:
            raise IndexError(f"page index {index} out of range [0, {self.num_pages})")
        start = index * self.page_nbytes
        return self._flat_view[start : start + self.page_nbytes]
