"""Scenario 6: the KV event stream of a real worker joins late, then its publisher restarts.

The proxy's event component (``pdproxy.routing.kv.event_feeds.EventFeeds`` over a
``MemoryIndex``) follows a real worker process:

- joining after the worker already published, it replays the missed batches from the worker's
  replay socket (the index knows blocks stored before it subscribed);
- when the worker is SIGKILLed and restarted (its sequence numbers start over), the first new
  batch resets the node: residency from the dead process is forgotten, never trusted again.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvtier.keys import BlockHasher
from kvtier.residency.memory import MemoryIndex
from kvtier.residency.types import NodeId
from pdproxy.routing.kv.event_feeds import EventFeeds

from .legs import completion
from .procs import ProcessGroup
from .record import Tally

pytestmark = pytest.mark.slow

_NODE = NodeId("w")


async def _held(index: MemoryIndex, hasher: BlockHasher, prompt: str) -> int:
    hashes = hasher.hash_tokens(list(prompt.encode("utf-8")))
    match = (await index.match(hashes)).get(_NODE)
    return match.total if match is not None else 0


async def _until(predicate_s: float, check: object) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < predicate_s:
        if await check():  # type: ignore[operator]
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    return None


async def test_event_stream_replay_and_publisher_restart(procs: ProcessGroup, tally: Tally) -> None:
    worker = procs.worker("w", role="both", events=True)
    assert worker.events_endpoint and worker.replay_endpoint
    hasher = BlockHasher("kvtier-sim/seed=0", 16)
    index = MemoryIndex(hasher)
    errors: list[int] = []
    feeds = EventFeeds(index, lambda: errors.append(1))
    before = "Stored before the router subscribed. " * 6
    stale = "Cached by a process that is about to die. " * 6
    fresh = "Cached by the restarted process. " * 6
    body = {"max_tokens": 2, "temperature": 0}
    async with httpx.AsyncClient(timeout=30) as client:
        try:
            await completion(client, worker.url, {**body, "prompt": before})
            await asyncio.sleep(0.2)
            # 1. Late join: the batches published before the subscription are replayed.
            await feeds.subscribe("w", worker.events_endpoint, worker.replay_endpoint)

            async def knows_before() -> bool:
                return await _held(index, hasher, before) > 0

            replayed_in = await _until(5, knows_before)
            sub = feeds.subscriber("w")
            assert sub is not None
            if replayed_in is None:
                tally.fail("blocks stored before the subscription were never replayed")
            else:
                tally.ok(fallback=True)
                tally.notes.append(f"late join replayed {sub.stats.replayed} batches")
            await completion(client, worker.url, {**body, "prompt": stale})

            async def knows_stale() -> bool:
                return await _held(index, hasher, stale) > 0

            assert await _until(5, knows_stale) is not None, "live events never applied"
            tally.ok()

            # 2. The publisher dies and restarts on the same endpoints: sequence starts over.
            worker.kill()
            worker.launch()
            worker.wait_healthy()
            await completion(client, worker.url, {**body, "prompt": fresh})

            polls = 0

            async def reset_done() -> bool:
                nonlocal polls
                polls += 1
                if polls % 25 == 0:
                    # ZMQ drops what a restarted publisher sends before the subscriber has
                    # reconnected (slow joiner); the restart is detected at the next batch that
                    # arrives, so keep the worker busy as live traffic would.
                    await completion(
                        client, worker.url, {**body, "prompt": f"Filler {polls}. " * 6}
                    )
                return (
                    await _held(index, hasher, fresh) > 0
                    and await _held(index, hasher, stale) == 0
                    and await _held(index, hasher, before) == 0
                )

            reset_in = await _until(5, reset_done)
            if reset_in is None:
                held = await _held(index, hasher, stale)
                tally.fail(f"stale residency still trusted after restart ({held} blocks)")
            else:
                tally.ok(fallback=True)
                tally.notes.append(
                    f"restart detected, node reset in {reset_in:.2f} s "
                    f"(resets={sub.stats.resets}, gaps={sub.stats.gaps})"
                )
            assert sub.stats.resets >= 1
            assert not errors
        finally:
            await feeds.close()
    assert tally.failed == 0, tally.notes
