"""One child process for the length of a ``with`` block: the benchmarks' helper processes.

Stopped on every path out of the block: SIGTERM, 10 s to exit, then SIGKILL (by PID: only
the process it started).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def child_process(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (stdout and stderr to ``log``, or stdout discarded without one)."""
    with contextlib.ExitStack() as files:
        out = files.enter_context(log.open("wb")) if log is not None else subprocess.DEVNULL
        err = subprocess.STDOUT if log is not None else None
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
