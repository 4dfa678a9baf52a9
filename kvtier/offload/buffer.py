"""Where host page bytes live: the :class:`PageBuffer` protocol and a pure-Python buffer.

``kvtier.pages.HostPages`` (a pinned uint8 torch tensor when CUDA is present) implements the
protocol in a worker; :class:`BytearrayPageBuffer` serves tests and hosts without torch.
"""

from __future__ import annotations

from typing import Protocol


class PageBuffer(Protocol):
    """Where page bytes live: ``num_pages`` pages of ``page_nbytes`` bytes each."""

    @property
    def num_pages(self) -> int: ...

    @property
    def page_nbytes(self) -> int: ...

    def page_view(self, index: int) -> memoryview:
        """A writable, contiguous, zero-copy view (format ``'B'``) of page ``index``."""
        ...


class BytearrayPageBuffer:
    """A :class:`PageBuffer` over one ``bytearray`` (tests, and hosts without torch)."""

    __slots__ = ("_num_pages", "_page_nbytes", "_view")

    def __init__(self, num_pages: int, page_nbytes: int) -> None:
        if num_pages <= 0 or page_nbytes <= 0:
            raise ValueError(f"need positive sizes, got {num_pages} pages of {page_nbytes} bytes")
        self._num_pages = num_pages
        self._page_nbytes = page_nbytes
        self._view = memoryview(bytearray(num_pages * page_nbytes))

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_nbytes(self) -> int:
        return self._page_nbytes

    def page_view(self, index: int) -> memoryview:
        if not 0 <= index < self._num_pages:
            raise IndexError(f"page index {index} out of range [0, {self._num_pages})")
        start = index * self._page_nbytes
        return self._view[start : start + self._page_nbytes]
