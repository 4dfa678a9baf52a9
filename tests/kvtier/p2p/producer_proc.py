"""A producer worker in its own process (for kill tests): ``python -m tests.kvtier.p2p.producer_proc
KV_REQUEST_ID READY PARKED``.

Supplies READY pages of ``make_keys(READY + PARKED)`` under KV_REQUEST_ID, parks the other
PARKED keys (their store never completes), prints its port, and serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

from kvtier.p2p import LocalIdentity, P2PServer, P2PTier, SupplyRegistry
from kvtier.p2p.frames import PeerNodeId

from .conftest import (
    FINGERPRINT,
    begin_write,
    make_keys,
    new_pool,
    producer_ctx,
    settings,
    write_page,
)


async def main(kv_request_id: str, ready: int, parked: int) -> None:
    config = settings(demand_wait_s=30.0)
    pool = new_pool()
    registry = SupplyRegistry(config.lease_s)
    server = P2PServer(config, LocalIdentity(PeerNodeId("proc"), FINGERPRINT, None), registry)
    await server.start()
    tier = P2PTier(pool, registry, FINGERPRINT)
    keys = make_keys(ready + parked)
    ctx = producer_ctx(kv_request_id, name="proc-leg")
    tier.on_new_request(ctx)
    for key in keys[:ready]:
        write_page(pool, key)
    tier.submit_store(keys[:ready], ctx)
    for key in keys[ready:]:
        begin_write(pool, key)
    tier.on_store_pending(keys[ready:], ctx)
    print(server.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
