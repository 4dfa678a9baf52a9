"""Benchmark: ``prepare_store`` + cascade of a 512-chunk request, cold vs fully warm.

    python -m loadtest.bench_offload [--chunks 512] [--seconds 2]

Prints µs per request for: a producer (REQUEST_LEVEL) request whose chunks are all new (cold:
allocate 512 pages, evicting old ones; complete the writes; cascade each key to the tier after
its write), and one whose chunks are all resident (fully warm: no copy, every key cascades at
once). The in-run baseline is the floor any implementation pays: one pool lookup per key.
Cases run round-robin (the machine is shared). Bounded in time; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

from kvtier.keys import BlockHash, OffloadKey, offload_key
from kvtier.offload import (
    BytearrayPageBuffer,
    HostPagePool,
    ReqContext,
    RequestId,
    RequestOffloadingContext,
    SecondaryTier,
    TieringManager,
    TierName,
    producer_leg_policy,
)


class CountingTier(SecondaryTier):
    """A request-level tier that counts what it receives (the P2P tier's shape, no I/O)."""

    def __init__(self) -> None:
        self.received = 0

    @property
    def name(self) -> TierName:
        return TierName("count")

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(producer_leg_policy(ctx.kv_transfer_params))

    def accepts_store(self, key: OffloadKey, ctx: ReqContext) -> bool:
        return False

    def submit_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.received += len(keys)

    def on_request_finished(self, ctx: ReqContext) -> None:
        return


def _keys(start: int, n: int) -> list[OffloadKey]:
    return [offload_key(BlockHash(i.to_bytes(16, "big")), 0) for i in range(start, start + n)]


def _interleaved(fns: dict[str, Callable[[int], object]], seconds: float) -> dict[str, list[float]]:
    """µs samples per case, taken round-robin so every case sees the same machine noise."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    deadline = time.monotonic() + seconds
    i = 0
    while (time.monotonic() < deadline or i < 3) and i < 100_000:
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            fn(i)
            samples[name].append((time.perf_counter_ns() - t0) / 1000)
        i += 1
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    n = args.chunks
    params = {"remote_decoder": {"kv_request_id": "bench"}}
    pool = HostPagePool(BytearrayPageBuffer(2 * n, 64))
    tier = CountingTier()
    manager = TieringManager(pool, [tier])
    warm_keys = _keys(0, n)

    def cold(i: int) -> None:
        ctx = ReqContext(RequestId(f"cold-{i}"), params)
        manager.on_new_request(ctx)
        out = manager.prepare_store(_keys((i + 1) * n, n), ctx)
        manager.complete_store(out.keys_to_store, ctx, True)
        manager.on_request_finished(ctx)

    def warm(i: int) -> None:
        ctx = ReqContext(RequestId(f"warm-{i}"), params)
        manager.on_new_request(ctx)
        out = manager.prepare_store(warm_keys, ctx)
        assert not out.keys_to_store
        manager.on_request_finished(ctx)

    def floor(i: int) -> None:
        lookup = pool.lookup
        for k in warm_keys:
            lookup(k)

    # make the warm keys resident; cold runs then evict earlier cold keys (the LRU), since each
    # warm run touches the warm keys
    seed = ReqContext(RequestId("seed"))
    manager.on_new_request(seed)
    manager.complete_store(manager.prepare_store(warm_keys, seed).keys_to_store, seed, True)
    manager.on_request_finished(seed)
    rows = _interleaved(
        {
            "floor: pool.lookup per key": floor,
            "cold (copy all, cascade on completion)": cold,
            "fully warm (no copy, cascade at once)": warm,
        },
        args.seconds,
    )
    base = statistics.median(rows["floor: pool.lookup per key"])
    print(f"{n}-chunk REQUEST_LEVEL request, pool of {2 * n} pages; µs per request")
    print(f"{'case':42} {'runs':>7} {'p50 µs':>10} {'p99 µs':>10} {'x floor':>8} {'ns/key':>8}")
    for name, samples in rows.items():
        samples.sort()
        p50 = statistics.median(samples)
        p99 = samples[max(0, int(len(samples) * 0.99) - 1)]
        print(
            f"{name:42} {len(samples):7d} {p50:10.1f} {p99:10.1f} "
            f"{p50 / base:8.1f} {p50 * 1000 / n:8.0f}"
        )
    print(f"keys received by the request-level tier: {tier.received}")
    manager.close()


if __name__ == "__main__":
    main()
