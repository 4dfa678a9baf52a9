"""The attacker of ``test_kv_event_floods``, a process of its own: binds a KV event publisher,
prints its endpoint, waits for a line on stdin, publishes ``BATCHES`` valid batches of
``BLOCKS`` blocks each (all new blocks of one node), prints ``done``, and exits once stdin
closes.

``python -m tests.kvtier.events.flood_publisher``"""

from __future__ import annotations

import asyncio
import sys

from kvtier.events import BlockStored, EventBatch, EventPublisher

BS = 16
BLOCKS = 64 * 1024
"""~3.2 MiB encoded: under the 4 MiB message cap."""
BATCHES = 12


def flood_batch(i: int) -> EventBatch:
    first = (i + 1) << 24
    tokens = tuple(256 + (first + j) % 60_000 for j in range(BLOCKS * BS))
    hashes = tuple(range(first, first + BLOCKS))
    return EventBatch(float(i), (BlockStored(hashes, None, tokens, BS),))


async def main() -> None:
    async with EventPublisher("tcp://127.0.0.1:*") as pub:
        print(pub.endpoint, flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        for i in range(BATCHES):
            await pub.publish(flood_batch(i))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the last ones leave the socket
        print("done", flush=True)
        await asyncio.to_thread(sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main())
