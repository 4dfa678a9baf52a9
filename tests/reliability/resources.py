"""Resource samples of a running worker: RSS and fds from /proc, the rest from its /metrics.

A *leak* is a resource that does not return to its baseline once the process is idle again:
device or host pages still referenced, supplies still held, tasks or fds that stayed, RSS that
kept growing past a stated tolerance.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format → ``{"name{labels}": value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is not None:
            out[m.group(1)] = float(m.group(2))
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


# Gauges that must be exactly back at their idle value (zero) when nothing is in flight.
ZERO_GAUGES = (
    "kvtier_worker_running_requests",
    "kvtier_worker_waiting_requests",
    "kvtier_worker_p2p_supplies",
    "kvtier_worker_p2p_supply_pages",
    "kvtier_worker_p2p_sending_pages",
    "kvtier_worker_host_referenced_pages",
    "kvtier_worker_host_writing_pages",
    "kvtier_worker_offload_requests",
)
_REFERENCED_PAGES = "kvtier_worker_kv_referenced_pages"


@dataclass(frozen=True, slots=True)
class Tolerance:
    """How far a sample may sit above its baseline and still count as 'back at baseline'."""

    rss_bytes: int = 64 * 1024 * 1024
    fds: int = 4
    tasks: int = 3


@dataclass(frozen=True, slots=True)
class WorkerSample:
    rss: int
    fds: int
    tasks: int
    gauges: dict[str, float]

    @property
    def referenced_device_pages(self) -> float:
        return sum(v for k, v in self.gauges.items() if k.startswith(_REFERENCED_PAGES))

    def leaks_against(self, base: WorkerSample, tol: Tolerance) -> list[str]:
        """Human-readable leaks of this (idle) sample against the idle ``base``."""
        leaks: list[str] = []
        if self.rss - base.rss > tol.rss_bytes:
            leaks.append(f"rss +{(self.rss - base.rss) / 2**20:.1f} MiB")
        if self.fds - base.fds > tol.fds:
            leaks.append(f"fds {base.fds}->{self.fds}")
        if self.tasks - base.tasks > tol.tasks:
            leaks.append(f"asyncio tasks {base.tasks}->{self.tasks}")
        if self.referenced_device_pages:
            leaks.append(f"device pages referenced: {self.referenced_device_pages:.0f}")
        for name in ZERO_GAUGES:
            value = self.gauges.get(name, 0.0)
            if value:
                leaks.append(f"{name.removeprefix('kvtier_worker_')}={value:.0f}")
        return leaks


def sample_worker(url: str, pid: int) -> WorkerSample:
    gauges = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
    return WorkerSample(
        rss=rss_bytes(pid),
        fds=open_fds(pid),
        tasks=int(gauges.get("kvtier_worker_asyncio_tasks", 0)),
        gauges=gauges,
    )


def settle(
    url: str, pid: int, base: WorkerSample, tol: Tolerance, timeout_s: float = 10.0
) -> tuple[WorkerSample, list[str]]:
    """Sample until no leak is left or ``timeout_s`` passes (releases are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = sample_worker(url, pid)
        leaks = now.leaks_against(base, tol)
        if not leaks or time.monotonic() > deadline:
            return now, leaks
        time.sleep(0.1)
