"""One child process of the stack: what to run, and the running process with its log file.

Each child runs in its own session (so the terminal's Ctrl-C reaches only the supervisor, which
stops children in order) and, on Linux, with a parent-death signal, so it never outlives a
supervisor that was killed outright. Stopping signals the child's own process group: the PID
this module started and anything that PID started.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """A process to start: argv, extra environment, and the URL that says it is healthy."""

    name: str
    argv: tuple[str, ...]
    health_url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    role: str = ""
    """What the process is to the stack (``proxy``, ``producer``, ``consumer``); for display."""


@dataclass(frozen=True, slots=True)
class ExitInfo:
    name: str
    pid: int
    returncode: int
    killed: bool
    """True when SIGTERM was not enough and the process group got SIGKILL."""


def _child_setup(parent_pid: int) -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


class ChildProcess:
    """A started :class:`ProcessSpec`; stdout and stderr go to ``log_path``."""

    def __init__(self, spec: ProcessSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        env = dict(os.environ)
        env.update(spec.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log: IO[bytes] = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        try:
            self._proc = subprocess.Popen(
                list(spec.argv),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=functools.partial(_child_setup, os.getpid()),  # noqa: PLW1509
            )
        except BaseException:
            self._log.close()
            raise
        logger.debug("started %s pid=%d: %s", spec.name, self._proc.pid, " ".join(spec.argv))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def log_tail(self, max_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-max_lines:])

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's process group (its PID: it leads its own session)."""
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            self._proc.send_signal(sig)

    def wait(self, deadline: float) -> int | None:
        """The return code, or None if the child is still running at ``deadline`` (monotonic)."""
        try:
            return self._proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def close_log(self) -> None:
        self._log.close()

    def group_alive(self) -> bool:
        """Whether any process of the child's process group still runs. Zombies do not count:
        vLLM's engine processes linger as zombies for a moment after a clean exit, until init
        reaps them, and must not read as a child that ignored SIGTERM."""
        proc = Path("/proc")
        if proc.is_dir():
            return any(_runs_in_group(entry, self._proc.pid) for entry in proc.iterdir())
        try:
            os.killpg(self._proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _runs_in_group(entry: Path, pgid: int) -> bool:
    if not entry.name.isdigit():
        return False
    try:
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False  # gone meanwhile
    return fields[0] != "Z" and int(fields[2]) == pgid
