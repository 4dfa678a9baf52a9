"""Attackers of the proxy's front: sockets held open from chosen source addresses, and the
resident memory of a whole ``pdproxy serve`` group (supervisor and children)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from .procs import ManagedProcess
from .resources import rss_bytes


def group_rss(proxy: ManagedProcess) -> int:
    """RSS of the proxy: the supervisor and every child process it forked."""
    pids = [proxy.pid]
    with contextlib.suppress(OSError), open(f"/proc/{proxy.pid}/task/{proxy.pid}/children") as f:
        pids += [int(p) for p in f.read().split()]
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            total += rss_bytes(pid)
    return total


def port_of(proxy: ManagedProcess) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


@dataclass
class HeldSockets:
    """Connections held open by one attacker, from ``sources`` in turn; counts what the proxy
    did to them."""

    port: int
    sources: list[str]
    opened: int = 0
    closed_by_proxy: int = 0
    lifetimes: list[float] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def _hold(self, source: str, dribble: bytes | None) -> None:
        """One connection: silent (``dribble`` None) or sending ``dribble`` a byte every
        0.3 s; returns once the proxy closes it (or it is cancelled)."""
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, local_addr=(source, 0)
        )
        self.opened += 1
        started = time.monotonic()
        try:
            pos = 0
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(4096), 0.3)
                except TimeoutError:
                    if dribble is not None and pos < len(dribble):
                        writer.write(dribble[pos : pos + 1])
                        pos += 1
                    continue
                if not data:
                    break  # the proxy closed it (a 408 first, or nothing)
            self.closed_by_proxy += 1
            self.lifetimes.append(time.monotonic() - started)
        except OSError:
            self.closed_by_proxy += 1
            self.lifetimes.append(time.monotonic() - started)
        finally:
            writer.transport.abort()

    def open(self, count: int, *, dribbling: int = 0) -> None:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nX-Pad: " + b"a" * 4096
        for i in range(count):
            source = self.sources[i % len(self.sources)]
            task = asyncio.create_task(self._hold(source, head if i < dribbling else None))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @property
    def held(self) -> int:
        return self.opened - self.closed_by_proxy

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
