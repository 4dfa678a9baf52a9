"""Helpers for stack tests: toy service specs and process-liveness checks."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pdproxy.stack.process import ProcessSpec
from tests.conftest import free_port

TOY = Path(__file__).with_name("toy_service.py")


def toy_spec(name: str, *flags: str, role: str = "toy") -> ProcessSpec:
    port = free_port()
    return ProcessSpec(
        name=name,
        argv=(sys.executable, str(TOY), "--port", str(port), *flags),
        health_url=f"http://127.0.0.1:{port}/health",
        role=role,
    )


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The PIDs still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    return alive
