"""Waiting for an admission slot while still hearing the client leave.

The body is read only once a request holds a slot, so a queued request has not read it yet. To
notice a client that leaves while queued, the wait also takes one message from the client: a
disconnect ends the wait at once (the queue position is freed); a body that has fully arrived
is kept and the wait goes on listening for a disconnect; a body still arriving is kept as far
as it came (at most what the server buffers for one unread request) and the wait stops
listening, so no request ever buffers more than that before it is admitted.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from kvtier.tasks import cancel_and_wait
from pdproxy.lease import RequestLease


async def wait_for_slot(lease: RequestLease, receive: Receive) -> list[Message]:
    """The client's messages received while queued (body chunks); raises
    :class:`~starlette.requests.ClientDisconnect` when the client left, or
    :class:`~pdproxy.errors.Overloaded` when the queue refused the request."""
    admitted: asyncio.Task[None] = asyncio.ensure_future(lease.admit())
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
