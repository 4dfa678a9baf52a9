"""Copy jobs between device pages and host pages, behind one submit/poll/wait interface.

A job copies whole pages: host page ``page_ids[j]`` holds device blocks
``block_ids[j * blocks_per_page : (j + 1) * blocks_per_page]`` back to back. Each job is one
batched gather and one copy (``index_select``/``index_copy_``), never one copy per page; when
the host pages form one ascending run (the common case for a fresh pool) the gather writes
straight into them.

- CUDA: the job runs on the copier's own stream, after the work already queued on the current
  stream (so KV just computed is what gets copied); an event marks its end. ``poll`` reports
  finished jobs without blocking; ``wait`` blocks up to a deadline. The engine must not overwrite
  the source blocks/pages of a job until it is reported finished.
- CPU: the copy happens synchronously in ``submit``; the job is reported by the next ``poll`` or
  ``wait``.

Every job is reported exactly once, by ``poll`` or by ``wait``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NewType

import torch

from kvtier.errors import PageCopyError
from kvtier.pages.memory import DevicePages, HostPages

CopyJobId = NewType("CopyJobId", int)

_POLL_SLEEP_S = 20e-6


class CopyDirection(enum.Enum):
    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"


@dataclass(frozen=True, slots=True)
class CompletedCopy:
    """A finished job."""

    job_id: CopyJobId
    direction: CopyDirection
    num_pages: int
    nbytes: int


@dataclass(slots=True, eq=False)
class _Job:
    done: CompletedCopy
    event: torch.cuda.Event | None = None
    finish: Callable[[], None] | None = None
    keepalive: tuple[torch.Tensor, ...] = field(default=())


def _word_dtype(*nbytes: int) -> torch.dtype:
    """The widest integer dtype dividing every size: copies move words, not bytes (torch's
    gather/scatter kernels are several times faster per byte on wide elements)."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(n % size == 0 for n in nbytes):
            return dtype
    return torch.uint8


def _ascending_run(ids: Sequence[int]) -> int | None:
    """First id if ``ids`` is ``first, first + 1, ...``; else ``None``."""
    first = ids[0]
    return first if all(v == first + i for i, v in enumerate(ids)) else None


class PageCopier:
    """Copies between one :class:`DevicePages` and one :class:`HostPages`."""

    def __init__(
        self, device_pages: DevicePages, host_pages: HostPages, blocks_per_page: int
    ) -> None:
        if blocks_per_page <= 0:
            raise ValueError(f"blocks_per_page must be positive, got {blocks_per_page}")
        used = blocks_per_page * device_pages.block_nbytes
        if used > host_pages.page_nbytes:
            raise ValueError(
                f"{blocks_per_page} blocks of {device_pages.block_nbytes} bytes do not fit "
                f"a host page of {host_pages.page_nbytes} bytes"
            )
        self._dev = device_pages
        self._host = host_pages
        self._bpp = blocks_per_page
        self._used = used
        self._full = used == host_pages.page_nbytes
        word = _word_dtype(device_pages.block_nbytes, host_pages.page_nbytes)
        self._dev_words = device_pages.block_bytes.view(word)  # [num_blocks, block_words]
        self._block_words = int(self._dev_words.shape[1])
        host_words = host_pages.tensor.view(word)  # [num_pages, page_words]
        self._host_words = host_words
        # the used part of every page, [num_pages, blocks_per_page * block_words] (strided when
        # pages are larger than what a job writes)
        self._host_used = host_words[:, : blocks_per_page * self._block_words]
        self._staging = torch.empty(0, dtype=word)  # CPU: reused between jobs
        self._cuda = device_pages.device.type == "cuda"
        self._stream = (
            torch.cuda.Stream(device_pages.device)  # type: ignore[no-untyped-call]
            if self._cuda
            else None
        )
        self._next_id = 0
        self._jobs: dict[CopyJobId, _Job] = {}

    @property
    def page_used_nbytes(self) -> int:
        """Bytes of each host page a job writes or reads (the rest of the page is untouched)."""
        return self._used

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet reported."""
        return len(self._jobs)

    # -- submit --------------------------------------------------------------------------------

    def submit(
        self, direction: CopyDirection, block_ids: Sequence[int], page_ids: Sequence[int]
    ) -> CopyJobId:
        """Start a copy of ``len(page_ids)`` pages; returns the job's id."""
        n = len(page_ids)
        if n == 0 or len(block_ids) != n * self._bpp:
            raise ValueError(
                f"need {self._bpp} block ids per page and at least one page, "
                f"got {len(block_ids)} block ids for {n} pages"
            )
        self._check_range(block_ids, self._dev.num_blocks, "block")
        self._check_range(page_ids, self._host.num_pages, "page")
        job_id = CopyJobId(self._next_id)
        self._next_id += 1
        done = CompletedCopy(job_id, direction, n, n * self._used)
        try:
            if self._cuda:
                job = self._submit_cuda(done, block_ids, page_ids)
            else:
                self._copy_cpu(direction, block_ids, page_ids)
                job = _Job(done)
        except RuntimeError as exc:
            raise PageCopyError(f"copy job {job_id} ({direction.value}) failed: {exc}") from exc
        self._jobs[job_id] = job
        return job_id

    @staticmethod
    def _check_range(ids: Sequence[int], limit: int, what: str) -> None:
        low, high = min(ids), max(ids)
        if low < 0 or high >= limit:
            raise ValueError(f"{what} ids must lie in [0, {limit}), got [{low}, {high}]")

    def _host_rows(self, page_ids: Sequence[int]) -> torch.Tensor | None:
        """The pages as ``[n * bpp, block_words]`` without a copy, if they allow it."""
        first = _ascending_run(page_ids)
        if first is None or not self._full:
            return None
        rows = self._host_words[first : first + len(page_ids)]
        return rows.view(len(page_ids) * self._bpp, self._block_words)

    def _staging_rows(self, n: int) -> torch.Tensor:
        """A reused CPU buffer of ``n`` pages as ``[n * bpp, block_words]`` (fresh memory per job
        would cost more in page faults than the copy itself)."""
        words = n * self._bpp * self._block_words
        if self._staging.numel() < words:
            self._staging = torch.empty(words, dtype=self._staging.dtype)
        return self._staging[:words].view(n * self._bpp, self._block_words)

    def _copy_cpu(
        self, direction: CopyDirection, block_ids: Sequence[int], page_ids: Sequence[int]
    ) -> None:
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        rows = self._host_rows(page_ids)
        n = len(page_ids)
        if direction is CopyDirection.DEVICE_TO_HOST:
            if rows is not None:  # one pass: gather straight into the pages
                torch.index_select(self._dev_words, 0, blocks, out=rows)
            else:  # gather, then scatter into the pages
                staged = self._staging_rows(n)
                torch.index_select(self._dev_words, 0, blocks, out=staged)
                pages = torch.as_tensor(page_ids, dtype=torch.long)
                self._host_used.index_copy_(0, pages, staged.view(n, -1))
        else:
            if rows is None:
                rows = self._staging_rows(n)
                pages = torch.as_tensor(page_ids, dtype=torch.long)
                torch.index_select(self._host_used, 0, pages, out=rows.view(n, -1))
            self._dev_words.index_copy_(0, blocks, rows)

    def _submit_cuda(
        self, done: CompletedCopy, block_ids: Sequence[int], page_ids: Sequence[int]
    ) -> _Job:
        stream = self._stream
        assert stream is not None
        device = self._dev.device
        n, bpp, bw = len(page_ids), self._bpp, self._block_words
        word = self._dev_words.dtype
        rows = self._host_rows(page_ids)
        pages = torch.as_tensor(page_ids, dtype=torch.long)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        finish: Callable[[], None] | None = None
        keep: list[torch.Tensor] = []
        stream.wait_stream(torch.cuda.current_stream(device))
        if done.direction is CopyDirection.HOST_TO_DEVICE and rows is None:
            staged = torch.empty((n, bpp * bw), dtype=word, pin_memory=True)
            torch.index_select(self._host_used, 0, pages, out=staged)
            rows = staged.view(n * bpp, bw)
        with torch.cuda.stream(stream):
            blocks = torch.as_tensor(block_ids, dtype=torch.long).to(device, non_blocking=True)
            keep.append(blocks)
            if done.direction is CopyDirection.DEVICE_TO_HOST:
                gathered = self._dev_words.index_select(0, blocks)
                keep.append(gathered)
                if rows is not None:
                    rows.copy_(gathered, non_blocking=True)
                else:
                    staging = torch.empty((n * bpp, bw), dtype=word, pin_memory=True)
                    staging.copy_(gathered, non_blocking=True)
                    keep.append(staging)
                    host_used = self._host_used

                    def finish() -> None:
                        host_used.index_copy_(0, pages, staging.view(n, bpp * bw))

            else:
                assert rows is not None
                keep.append(rows)
                on_device = rows.to(device, non_blocking=True)
                keep.append(on_device)
                self._dev_words.index_copy_(0, blocks, on_device)
            event.record(stream)
        return _Job(done, event, finish, tuple(keep))

    # -- completion ----------------------------------------------------------------------------

    def _finished(self, job: _Job) -> bool:
        return job.event is None or bool(job.event.query())  # type: ignore[no-untyped-call]

    def _report(self, job_id: CopyJobId) -> CompletedCopy:
        job = self._jobs.pop(job_id)
        if job.finish is not None:
            try:
                job.finish()
            except RuntimeError as exc:
                raise PageCopyError(f"copy job {job_id} failed to scatter: {exc}") from exc
        return job.done

    def poll(self) -> list[CompletedCopy]:
        """Jobs finished since the last report, in submission order (never blocks)."""
        ready = [job_id for job_id, job in self._jobs.items() if self._finished(job)]
        return [self._report(job_id) for job_id in ready]

    def wait(self, job_id: CopyJobId, timeout_s: float) -> CompletedCopy:
        """Block until ``job_id`` finishes; :class:`PageCopyError` after ``timeout_s``."""
        job = self._jobs.get(job_id)
        if job is None:
            raise PageCopyError(f"copy job {job_id} is unknown or already reported")
        deadline = time.monotonic() + timeout_s
        while not self._finished(job):
            if time.monotonic() >= deadline:
                raise PageCopyError(f"copy job {job_id} did not finish within {timeout_s} s")
            time.sleep(_POLL_SLEEP_S)
        return self._report(job_id)

    def wait_all(self, timeout_s: float) -> list[CompletedCopy]:
        """Wait for every job in flight (all within one deadline)."""
        deadline = time.monotonic() + timeout_s
        return [
            self.wait(job_id, max(0.0, deadline - time.monotonic())) for job_id in list(self._jobs)
        ]
