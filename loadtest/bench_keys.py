"""Benchmark: hashing an 8,192-token prompt into block hashes (prints; asserts nothing).

    python -m loadtest.bench_keys [--tokens 8192] [--repeat 2000]

Prints µs per prompt for one-shot hashing, the incremental hasher, and — as the in-run baseline
— a single xxh3_128 over the same bytes (the floor any chained scheme pays).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import xxhash

from kvtier.keys import BlockHasher, encode_tokens


def _time_us(fn: Callable[[], object], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(0, 128_000) for _ in range(args.tokens)]
    hasher = BlockHasher("bench-model", args.block_size)
    data = encode_tokens(prompt)

    def incremental() -> None:
        inc = hasher.start()
        for i in range(0, len(prompt), 1024):
            inc.extend(prompt[i : i + 1024])

    rows = {
        "xxh3_128 of whole prompt (floor)": _time_us(
            lambda: xxhash.xxh3_128_digest(data), args.repeat
        ),
        "BlockHasher.hash_tokens": _time_us(lambda: hasher.hash_tokens(prompt), args.repeat),
        "PromptHashes.extend (8 turns)": _time_us(incremental, args.repeat),
    }
    base = statistics.median(rows["xxh3_128 of whole prompt (floor)"])
    print(f"{args.tokens} tokens, block size {args.block_size}, {args.repeat} runs each")
    print(f"{'case':40} {'p50 µs':>10} {'p99 µs':>10} {'x floor':>8}")
    for name, samples in rows.items():
        samples.sort()
        p50 = statistics.median(samples)
        p99 = samples[int(len(samples) * 0.99) - 1]
        print(f"{name:40} {p50:10.1f} {p99:10.1f} {p50 / base:8.1f}")


if __name__ == "__main__":
    main()
