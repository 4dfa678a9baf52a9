"""The pool and manager under two threads: an engine storing, a sender reading pinned pages."""

from __future__ import annotations

import random
import threading
import time

from kvtier.errors import OffloadError, PoolExhausted, UnknownKey
from kvtier.keys import OffloadKey
from kvtier.offload import (
    BytearrayPageBuffer,
    HostPagePool,
    PageState,
    ReqContext,
    RequestId,
    TieringManager,
)
from tests.kvtier.offload.recording_tier import PRODUCER, RecordingTier, key

NBYTES = 16


def pattern(k: OffloadKey) -> bytes:
    return (k[12:16] * (NBYTES // 4))[:NBYTES]


def test_concurrent_store_and_send_never_corrupts_a_pinned_page() -> None:
    pool = HostPagePool(BytearrayPageBuffer(24, NBYTES))
    tier = RecordingTier("p2p", pool, accepts=lambda k: False)
    manager = TieringManager(pool, [tier])
    stop = time.monotonic() + 0.6
    errors: list[BaseException] = []

    def engine() -> None:
        rng = random.Random(1)
        i = 0
        try:
            while time.monotonic() < stop and i < 2000:
                ctx = ReqContext(RequestId(f"r{i}"), PRODUCER if i % 2 else None)
                manager.on_new_request(ctx)
                keys = [key(rng.randrange(60)) for _ in range(6)]
                out = manager.prepare_store(keys, ctx)
                for k in out.keys_to_store:
                    pool.write_view(k)[:] = pattern(k)
                manager.complete_store(out.keys_to_store, ctx, rng.random() > 0.1)
                manager.on_request_finished(ctx)
                i += 1
        except BaseException as exc:
            errors.append(exc)

    def sender() -> None:
        rng = random.Random(2)
        n = 0
        try:
            while time.monotonic() < stop and n < 20_000:
                k = key(rng.randrange(60, 80) if rng.random() < 0.2 else rng.randrange(60))
                n += 1
                if pool.state(k) is None and k[15] >= 60:  # an incoming page (a fetch)
                    try:
                        pool.allocate(k)
                    except (PoolExhausted, OffloadError):
                        continue
                    pool.write_view(k)[:] = pattern(k)
                    pool.complete_write(k, True)
                    continue
                try:
                    ref = pool.acquire(k)
                except UnknownKey:
                    continue
                with ref:
                    for _ in range(3):
                        assert bytes(ref.view) == pattern(k), "a pinned page changed"
                        time.sleep(0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=engine), threading.Thread(target=sender)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert tier.violations == []
    for rid, rec in tier.records.items():
        if rid.startswith("r") and int(rid[1:]) % 2:
            assert rec.finished
    stats = pool.stats()
    assert (stats.referenced, stats.writing) == (0, 0)
    assert all(pool.state(key(i)) in (None, PageState.READABLE) for i in range(80))
    assert manager.stats().requests == 0 and manager.stats().parked == 0
    manager.close()
