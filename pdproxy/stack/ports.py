"""Ports for the processes a launcher starts, chosen outside the kernel's ephemeral range.

Why not ``bind(port 0)``: the port it finds free comes from the ephemeral range
(``net.ipv4.ip_local_port_range``), the same range the kernel draws from for every outgoing
connection on the machine. A launcher learns the port, closes its probe socket and starts a child
that binds it seconds later (vLLM: tens of seconds); in between, any client's connect() may be
given that port as its local end, and the child dies with "address already in use" (seen in CI:
a worker of the reliability suite). Ports below (or above) the ephemeral range are never handed
out by the kernel, so only another launcher can take them.

Within one process, a cursor walks the range so that two calls never return the same port while
the first has not been bound yet (a probe bind cannot see a port that is promised but unbound).
The cursor starts at a random place so that two launchers on one machine (CI and a benchmark)
rarely walk the same ports; a port that is taken is skipped by the probe bind.
"""

from __future__ import annotations

import functools
import random
import socket
import threading
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
"""Below this lie well-known and registered service ports (databases, brokers) on this kind of
machine; a probe bind would skip a listening one, but not one whose service starts later."""
_MIN_SPAN = 1_000


class PortAllocator:
    """Hands out ports that were free when asked and that this allocator never handed out before
    (until it has walked its whole range). Thread-safe."""

    def __init__(self, low: int, high: int, seed: int | None = None) -> None:
        if not 0 < low < high <= 65_535:
            raise ValueError(f"bad port range {low}..{high}")
        self._low, self._span = low, high - low + 1
        self._offset = random.Random(seed).randrange(self._span)
        self._lock = threading.Lock()

    def port(self, host: str = "127.0.0.1") -> int:
        """One free port."""
        return self.run(1, host)

    def ports(self, n: int, host: str = "127.0.0.1") -> list[int]:
        """``n`` distinct free ports (not necessarily consecutive)."""
        return [self.run(1, host) for _ in range(n)]

    def run(self, n: int, host: str = "127.0.0.1") -> int:
        """The first of ``n`` consecutive free ports (for processes that number their ports
        ``base + rank``)."""
        if not 0 < n < self._span:
            raise ValueError(f"cannot find {n} consecutive ports in a range of {self._span}")
        with self._lock:
            for _ in range(self._span):
                if self._offset + n > self._span:
                    self._offset = 0
                base = self._low + self._offset
                self._offset += n
                if all(_bindable(host, base + i) for i in range(n)):
                    return base
        raise OSError(f"no {n} consecutive free ports in {self._low}..{self._low + self._span - 1}")


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port in TIME_WAIT counts as taken, which servers that set it could use,
    # but skipping it costs nothing.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def non_ephemeral_range(ephemeral: tuple[int, int]) -> tuple[int, int]:
    """The larger stretch of ports outside ``ephemeral`` and above the service ports."""
    low, high = ephemeral
    below = (_LOWEST, low - 1)
    above = (max(high + 1, _LOWEST), 65_535)
    best = max(below, above, key=lambda r: r[1] - r[0])
    if best[1] - best[0] + 1 < _MIN_SPAN:
        raise OSError(f"the ephemeral range {low}..{high} leaves no room for launched processes")
    return best


def _read_ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in _EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return (32_768, 60_999)  # Linux's default
    return (low, high)


@functools.cache
def _allocator() -> PortAllocator:
    """Process-wide on purpose: the promise "not handed out before" only holds if every caller in
    the process draws from one cursor. Built on first use, not at import."""
    return PortAllocator(*non_ephemeral_range(_read_ephemeral_range()))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, outside the ephemeral range, not returned before by this process."""
    return _allocator().port(host)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct such ports."""
    return _allocator().ports(n, host)


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive such ports."""
    return _allocator().run(n, host)
