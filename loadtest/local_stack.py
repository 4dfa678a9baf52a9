"""Run the local PD stack (``python -m pdproxy.stack``) for the length of a benchmark.

The stack runs as a subprocess on a free port; leaving the context stops it with SIGINT (the
stack then stops every process it started) and waits for it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdproxy.stack.ports import free_port


@dataclass(frozen=True, slots=True)
class RunningStack:
    endpoint: str
    model: str
    log_path: Path


class StackDidNotStart(RuntimeError):
    """The local stack exited or did not get ready in time."""


@contextmanager
def local_stack(
    stack_args: Sequence[str], startup_timeout_s: float = 180.0
) -> Iterator[RunningStack]:
    """Start ``python -m pdproxy.stack STACK_ARGS`` and yield its endpoint once healthy."""
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        run_dir = Path(tmp)
        ready = run_dir / "ready.json"
        log_path = run_dir / "stack.log"
        argv = [
            sys.executable, "-m", "pdproxy.stack", *stack_args,
            "--port", str(free_port()),
            "--run-dir", str(run_dir / "run"),
            "--ready-file", str(ready),
            "--status-interval", "0",
            "--startup-timeout", str(startup_timeout_s),
        ]  # fmt: skip
        with log_path.open("w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + startup_timeout_s + 10
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise StackDidNotStart(f"local stack did not start:\n{tail}")
                time.sleep(0.1)
            info = json.loads(ready.read_text())
            yield RunningStack(str(info["endpoint"]), str(info["model"]), log_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
