"""Start a set of processes, wait until all are healthy, watch them, stop them all.

Synchronous on purpose: it runs in the CLI's main thread, where signal handlers run too, and it
only polls (process state and one health URL per process).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdproxy.stack.errors import ProcessExited, StartupFailed
from pdproxy.stack.process import ChildProcess, ExitInfo, ProcessSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    name: str
    role: str
    pid: int
    running: bool
    healthy: bool
    detail: str
    """Short text from the health answer (its scalar JSON fields) or the exit code."""


class Supervisor:
    """Owns every process it starts; :meth:`stop` (also on ``with`` exit) ends them all."""

    def __init__(
        self,
        log_dir: Path,
        *,
        stop_grace_s: float = 10.0,
        health_timeout_s: float = 1.0,
    ) -> None:
        self._log_dir = log_dir
        self._grace = stop_grace_s
        self._children: list[ChildProcess] = []
        self._http = httpx.Client(timeout=health_timeout_s, trust_env=False)
        self._stopped = False

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def children(self) -> list[ChildProcess]:
        return list(self._children)

    def start(self, specs: Sequence[ProcessSpec]) -> None:
        """Start ``specs`` (in order, without waiting between them)."""
        names = [c.spec.name for c in self._children] + [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique: {names}")
        if self._stopped:
            raise RuntimeError("this supervisor has stopped")
        self._log_dir.mkdir(parents=True, exist_ok=True)
        for spec in specs:
            self._children.append(ChildProcess(spec, self._log_dir))
            logger.info("started %s (pid %d)", spec.name, self._children[-1].pid)

    def wait_healthy(self, timeout_s: float, stop: threading.Event | None = None) -> None:
        """Return once every started process answers its health URL, else
        raise :class:`StartupFailed`."""
        deadline = time.monotonic() + timeout_s
        pending = [c for c in self._children if c.spec.health_url is not None]
        while pending:
            for child in list(pending):
                rc = child.poll()
                if rc is not None:
                    raise StartupFailed(
                        f"{child.spec.name} exited with code {rc} during start-up; "
                        f"last lines of {child.log_path}:\n{child.log_tail()}"
                    )
                if self._probe(child)[0]:
                    logger.info("%s is healthy", child.spec.name)
                    pending.remove(child)
            if not pending:
                return
            if stop is not None and stop.is_set():
                raise StartupFailed("stopped while starting")
            if time.monotonic() > deadline:
                names = ", ".join(c.spec.name for c in pending)
                tails = "\n".join(
                    f"--- {c.log_path}:\n{c.log_tail(10)}" for c in pending if c.log_tail(10)
                )
                raise StartupFailed(f"not healthy after {timeout_s:.0f} s: {names}\n{tails}")
            if stop is not None:
                stop.wait(0.1)
            else:
                time.sleep(0.1)

    def check_running(self) -> None:
        """Raise :class:`ProcessExited` if any process has exited."""
        for child in self._children:
            rc = child.poll()
            if rc is not None:
                raise ProcessExited(
                    f"{child.spec.name} (pid {child.pid}) exited with code {rc}; "
                    f"last lines of {child.log_path}:\n{child.log_tail()}"
                )

    def statuses(self) -> list[ProcessStatus]:
        out = []
        for child in self._children:
            rc = child.poll()
            if rc is not None:
                out.append(ProcessStatus(child.spec.name, child.spec.role, child.pid, False,
                                         False, f"exited {rc}"))  # fmt: skip
                continue
            healthy, detail = self._probe(child)
            out.append(ProcessStatus(child.spec.name, child.spec.role, child.pid, True,
                                     healthy, detail))  # fmt: skip
        return out

    def _probe(self, child: ChildProcess) -> tuple[bool, str]:
        url = child.spec.health_url
        if url is None:
            return True, ""
        try:
            resp = self._http.get(url)
        except httpx.HTTPError as exc:
            return False, type(exc).__name__
        if resp.status_code != 200:
            return False, f"HTTP {resp.status_code}"
        return True, _summary(resp)

    def stop(self) -> list[ExitInfo]:
        """SIGTERM every process group (last started first), then SIGKILL what remains."""
        if self._stopped:
            return []
        self._stopped = True
        children = list(reversed(self._children))
        for child in children:
            if child.poll() is None:
                child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        report = []
        for child in children:
            rc = child.wait(deadline)
            while rc is not None and child.group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)  # the leader exited; its own children are finishing
            killed = False
            if rc is None or child.group_alive():
                logger.warning("%s (pid %d) ignored SIGTERM: killing", child.spec.name, child.pid)
                child.signal_group(signal.SIGKILL)
                rc = child.wait(time.monotonic() + 5.0)
                killed = True
            child.close_log()
            report.append(ExitInfo(child.spec.name, child.pid, -9 if rc is None else rc, killed))
        self._http.close()
        return report


def _summary(resp: httpx.Response) -> str:
    """Scalar fields of a JSON health answer, e.g. ``status=ok running=2``."""
    try:
        doc: Any = resp.json()
    except ValueError:
        return ""
    if not isinstance(doc, dict):
        return ""
    parts = [
        f"{k}={v}" for k, v in doc.items() if isinstance(v, str | int | float | bool) and k != "ok"
    ]
    return " ".join(parts[:6])
