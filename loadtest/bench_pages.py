"""Benchmark: page copy jobs GPU→host and host→GPU against one contiguous torch copy.

    python -m loadtest.bench_pages [--pages 128] [--blocks-per-page 2] [--seconds 2]

On the present device (``cuda`` when available, else CPU) it times copy jobs of ``--pages``
pages (device blocks gathered in scattered order; host pages as one run, and scattered) and, as
the in-run baseline, ``torch`` copying one contiguous tensor of the same size between the same
memories. Prints GB/s and the ratio to the baseline (target ≥ 0.8). Bounded; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.pages import CopyDirection, DevicePages, HostPages, PageCopier, default_device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved_gbps(
    fns: dict[str, Callable[[], object]], nbytes: int, device: torch.device, seconds: float
) -> dict[str, float]:
    """GB/s of each function from the median of samples taken round-robin (this machine is
    shared: interleaving exposes every case to the same noise)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    _sync(device)
    deadline = time.monotonic() + seconds
    rounds = 0
    while (time.monotonic() < deadline or rounds < 3) and rounds < 10_000:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: nbytes / statistics.median(s) / 1e9 for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--blocks-per-page", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--block-shape", default="4,2,16,8,128", help="layers,K/V,tokens,heads,dim")
    args = parser.parse_args()
    device = default_device()
    shape = tuple(int(x) for x in args.block_shape.split(","))
    n_pages, bpp = args.pages, args.blocks_per_page
    n_blocks = 2 * n_pages * bpp
    dev = DevicePages.allocate(n_blocks, shape, torch.float16, device)
    dev.tensor.normal_()
    host = HostPages(2 * n_pages, bpp * dev.block_nbytes)
    copier = PageCopier(dev, host, bpp)
    rng = random.Random(0)
    blocks = rng.sample(range(n_blocks), n_pages * bpp)
    run_pages = list(range(n_pages))
    scattered_pages = rng.sample(range(2 * n_pages), n_pages)
    nbytes = n_pages * copier.page_used_nbytes

    # baseline: one contiguous tensor of the same size, same memories
    dev_flat = dev.block_bytes[: n_pages * bpp]
    host_flat = host.tensor[:n_pages].view(n_pages * bpp, dev.block_nbytes)

    def job(direction: CopyDirection, pages: list[int]) -> Callable[[], object]:
        return lambda: copier.wait(copier.submit(direction, blocks, pages), timeout_s=60)

    d2h, h2d = CopyDirection.DEVICE_TO_HOST, CopyDirection.HOST_TO_DEVICE
    non_blocking = device.type == "cuda"
    fns: dict[str, Callable[[], object]] = {
        "base d2h": lambda: host_flat.copy_(dev_flat, non_blocking=non_blocking),
        "base h2d": lambda: dev_flat.copy_(host_flat, non_blocking=non_blocking),
        "GPU→host, host pages one run": job(d2h, run_pages),
        "GPU→host, host pages scattered": job(d2h, scattered_pages),
        "host→GPU, host pages one run": job(h2d, run_pages),
        "host→GPU, host pages scattered": job(h2d, scattered_pages),
    }
    gbps = _interleaved_gbps(fns, nbytes, device, args.seconds)
    base_d2h, base_h2d = gbps.pop("base d2h"), gbps.pop("base h2d")
    rows = [(name, v, base_d2h if "GPU→host" in name else base_h2d) for name, v in gbps.items()]
    print(
        f"device {device}, host pinned: {host.pinned}; {n_pages} pages of {bpp} blocks of "
        f"{dev.block_nbytes} B = {nbytes / 2**20:.0f} MiB per job; device blocks scattered"
    )
    print(
        f"baseline torch contiguous copy: GPU→host {base_d2h:.2f} GB/s, "
        f"host→GPU {base_h2d:.2f} GB/s"
    )
    print(f"{'case':34} {'GB/s':>8} {'x baseline':>11}")
    for name, rate, base in rows:
        print(f"{name:34} {rate:8.2f} {rate / base:11.2f}")


if __name__ == "__main__":
    main()
