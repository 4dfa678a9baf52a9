"""Admission control: at most ``max_concurrent`` requests run, a bounded FIFO queue waits.

A full queue or a wait past ``queue_timeout_s`` is refused with :class:`Overloaded` (429 with
``Retry-After``). Slots are handed directly from a finishing request to the oldest waiter.

:class:`ModelAdmission` applies the same rule per model (``models.default_limits`` and each
model's ``limits``) once the body has said which model a request is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable

from pdproxy.errors import Overloaded
from pdproxy.model_settings import ModelLimits, ModelsSettings
from pdproxy.settings import AdmissionSettings


class Admission:
    def __init__(self, settings: AdmissionSettings) -> None:
        self._settings = settings
        self._active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._retry_after = max(1, math.ceil(settings.queue_timeout_s / 2))

    @property
    def active(self) -> int:
        return self._active

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take a free slot now if there is one (no queue ahead)."""
        if self._active < self._settings.max_concurrent and not self._waiters:
            self._active += 1
            return True
        return False

    async def acquire(self) -> bool:
        """Take a slot; True when the request had to wait in the queue for it."""
        if self.try_acquire():
            return False
        if len(self._waiters) >= self._settings.queue_size:
            raise Overloaded("too many requests in flight; queue is full", self._retry_after)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._settings.queue_timeout_s):
                await waiter
        except TimeoutError as exc:
            if waiter.done() and not waiter.cancelled():
                return True  # the slot arrived as the timer fired: keep it
            raise Overloaded("timed out waiting for a free slot", self._retry_after) from exc
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # got the slot but we are leaving: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
        return True

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; _active unchanged
                return
        self._active -= 1


class _ModelBucket:
    """One model's admission (when it has limits) and its count of requests in flight."""

    __slots__ = ("admission", "in_flight")

    def __init__(self, limits: ModelLimits | None) -> None:
        self.admission = (
            Admission(
                AdmissionSettings(
                    max_concurrent=limits.max_concurrent,
                    queue_size=limits.queue_size,
                    queue_timeout_s=limits.queue_timeout_s,
                )
            )
            if limits is not None
            else None
        )
        self.in_flight = 0


class ModelSlot:
    """A request's place in its model's admission; released once, by the request's lease,
    with the status the client got (counted per model)."""

    __slots__ = ("_bucket", "_count", "label")

    def __init__(
        self, label: str, bucket: _ModelBucket, count: Callable[[str, int], None] | None
    ) -> None:
        self.label = label
        self._bucket: _ModelBucket | None = bucket
        self._count = count
        bucket.in_flight += 1

    def release(self, status: int) -> None:
        bucket, self._bucket = self._bucket, None
        if bucket is None:
            return
        bucket.in_flight -= 1
        if bucket.admission is not None:
            bucket.admission.release()
        if self._count is not None:
            self._count(self.label, status)


class ModelAdmission:
    """Admission per model, taken once the body names the model (the proxy-wide slot is
    already held). Buckets exist only for labels the model catalog hands out (known models and
    ``other``), so clients cannot grow this map."""

    def __init__(self, settings: ModelsSettings) -> None:
        self._settings = settings
        self._buckets: dict[str, _ModelBucket] = {}
        self.on_release: Callable[[str, int], None] | None = None
        """Called with (model label, status) as each slot is released (metrics)."""
        self.on_refused: Callable[[str], None] | None = None

    def _bucket(self, label: str) -> _ModelBucket:
        bucket = self._buckets.get(label)
        if bucket is None:
            bucket = self._buckets[label] = _ModelBucket(self._settings.limits_of(label))
        return bucket

    async def acquire(self, label: str) -> ModelSlot:
        """Raises :class:`Overloaded` (429) when the model's queue is full or the wait timed
        out; a cancelled wait gives its place back."""
        bucket = self._bucket(label)
        if bucket.admission is not None:
            try:
                await bucket.admission.acquire()
            except Overloaded:
                if self.on_refused is not None:
                    self.on_refused(label)
                raise
        return ModelSlot(label, bucket, self.on_release)

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(label, in flight, queued) per model seen so far."""
        return [
            (label, b.in_flight, b.admission.queue_depth if b.admission is not None else 0)
            for label, b in self._buckets.items()
        ]
