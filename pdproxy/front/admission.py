"""Admission control: at most ``max_concurrent`` requests run, a bounded FIFO queue waits.

A full queue or a wait past ``queue_timeout_s`` is refused with :class:`Overloaded` (429 with
``Retry-After``). Slots are handed directly from a finishing request to the oldest waiter.

:class:`ModelAdmission` applies the same rule per model (``models.default_limits`` and each
model's ``limits``) once the body has said which model a request is for.

Per-model metrics. The ``model`` label takes only names the model catalog knows (configured,
or learned from backends up to ``models.max_learned``) and ``other``: never a string a client
chose, so the number of series stays bounded. A learned name the catalog forgets (no backend
lists it any more: :meth:`ModelAdmission.forget`) loses its bucket and its series once nothing
is in flight or queued for it, so names that come and go do not pile up.

Waiting for an admission slot while still hearing the client leave.

The body is read only once a request holds a slot, so a queued request has not read it yet. To
notice a client that leaves while queued, the wait also takes one message from the client: a
disconnect ends the wait at once (the queue position is freed); a body that has fully arrived
is kept and the wait goes on listening for a disconnect; a body still arriving is kept as far
as it came (at most what the server buffers for one unread request) and the wait stops
listening, so no request ever buffers more than that before it is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from kvtier.tasks import cancel_and_wait
from pdproxy.errors import Overloaded
from pdproxy.observe.metrics import LoopCounter, status_label
from pdproxy.settings import AdmissionSettings
from pdproxy.settings.models import ModelLimits, ModelsSettings


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
        self._forgotten: set[str] = set()
        """Forgotten labels whose bucket still has requests in flight or queued."""
        self.on_release: Callable[[str, int], None] | None = None
        """Called with (model label, status) as each slot is released (metrics)."""
        self.on_refused: Callable[[str], None] | None = None
        self.on_dropped: Callable[[str], None] | None = None
        """Called with a forgotten label once its bucket is dropped (its series go too)."""

    def _bucket(self, label: str) -> _ModelBucket:
        bucket = self._buckets.get(label)
        if bucket is None:
            bucket = self._buckets[label] = _ModelBucket(self._settings.limits_of(label))
        return bucket

    async def acquire(self, label: str) -> ModelSlot:
        """Raises :class:`Overloaded` (429) when the model's queue is full or the wait timed
        out; a cancelled wait gives its place back."""
        self._forgotten.discard(label)  # named again: known again
        bucket = self._bucket(label)
        if bucket.admission is not None:
            try:
                await bucket.admission.acquire()
            except Overloaded:
                if self.on_refused is not None:
                    self.on_refused(label)
                self._drop_if_idle(label)
                raise
            except BaseException:  # cancelled while queued
                self._drop_if_idle(label)
                raise
        return ModelSlot(label, bucket, self._released)

    def forget(self, names: tuple[str, ...]) -> None:
        """The model catalog forgot ``names`` (:meth:`ModelCatalog.on_forget`; on the loop):
        each one's bucket is dropped now if idle, else when its last request leaves."""
        for label in names:
            if label in self._buckets:
                self._forgotten.add(label)
                self._drop_if_idle(label)

    def _released(self, label: str, status: int) -> None:
        if self.on_release is not None:
            self.on_release(label, status)
        self._drop_if_idle(label)

    def _drop_if_idle(self, label: str) -> None:
        if label not in self._forgotten:
            return
        bucket = self._buckets.get(label)
        if bucket is not None:
            if bucket.in_flight or (bucket.admission is not None and bucket.admission.active):
                return
            if bucket.admission is not None and bucket.admission.queue_depth:
                return
            del self._buckets[label]
        self._forgotten.discard(label)
        if self.on_dropped is not None:
            self.on_dropped(label)

    def snapshot(self) -> list[tuple[str, int, int]]:
        """(label, in flight, queued) per model seen so far."""
        return [
            (label, b.in_flight, b.admission.queue_depth if b.admission is not None else 0)
            for label, b in self._buckets.items()
        ]


class _ModelLoad(Collector):
    def __init__(self, admission: ModelAdmission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "pdproxy_model_in_flight", "Requests in flight per model", labels=["model"]
        )
        queued = GaugeMetricFamily(
            "pdproxy_model_queue_depth",
            "Requests waiting for their model's admission",
            labels=["model"],
        )
        for label, active, waiting in self._admission.snapshot():
            in_flight.add_metric([label], active)
            queued.add_metric([label], waiting)
        yield from (in_flight, queued)


class ModelMetrics:
    def __init__(self, registry: CollectorRegistry, admission: ModelAdmission) -> None:
        # Counted once per request, on the loop: a plain number, not a locked child.
        self.requests = LoopCounter(
            "pdproxy_model_requests",
            "Client requests by model and status (models the proxy knows, else 'other')",
            ["model", "status"],
        )
        registry.register(self.requests)
        self.refused = Counter(
            "pdproxy_model_admission_refused",
            "Requests refused by their model's admission (queue full or wait timed out)",
            ["model"],
            registry=registry,
        )
        registry.register(_ModelLoad(admission))
        admission.on_release = self.count
        admission.on_refused = lambda label: self.refused.labels(label).inc()
        admission.on_dropped = self.drop

    def count(self, label: str, status: int) -> None:
        self.requests.child(label, status_label(status)).value += 1

    def drop(self, label: str) -> None:
        """Remove a forgotten model's series."""
        self.requests.forget("model", label)
        self.refused.remove(label)


async def wait_for_slot(admit: Awaitable[None], receive: Receive) -> list[Message]:
    """Wait for ``admit`` (the request taking its slot) while listening to the client.

    Returns the client's messages received while queued (body chunks); raises
    :class:`~starlette.requests.ClientDisconnect` when the client left, or
    :class:`~pdproxy.errors.Overloaded` when the queue refused the request."""
    admitted: asyncio.Task[None] = asyncio.ensure_future(admit)
    watch: asyncio.Future[Any] | None = asyncio.ensure_future(receive())
    received: list[Message] = []
    try:
        while watch is not None:
            done, _ = await asyncio.wait({admitted, watch}, return_when=asyncio.FIRST_COMPLETED)
            if watch not in done:
                break
            message = watch.result()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            received.append(message)
            watch = asyncio.ensure_future(receive()) if not message.get("more_body") else None
        await admitted
        return received
    finally:
        await cancel_and_wait(*(t for t in (admitted, watch) if t is not None and not t.done()))
