"""Real processes of the reliability suite: workers, proxies, started on free ports, stopped by PID.

Every process a test starts is registered in a :class:`ProcessGroup`; the group stops them all
(SIGCONT first, in case a test paused one, then SIGTERM, then SIGKILL) when the test ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import free_port

_REPO = Path(__file__).resolve().parents[2]


class ProcessStartError(RuntimeError):
    """A process exited or never became healthy; carries the tail of its log."""


@dataclass
class ManagedProcess:
    """One subprocess with its log file; ``url`` is its HTTP base URL when it serves one."""

    name: str
    argv: list[str]
    log_path: Path
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self, env: dict[str, str] | None = None) -> None:
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=_REPO,
                env=env,
            )
        finally:
            log.close()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, path: str = "/health", timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                code = self.proc.returncode if self.proc is not None else None
                raise ProcessStartError(f"{self.name} exited ({code}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ProcessStartError(f"{self.name} not healthy in {timeout_s} s:\n{self.log_tail()}")

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL, and reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGCONT + SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


@dataclass
class WorkerProcess(ManagedProcess):
    role: str = "both"
    p2p_port: int = 0
    events_endpoint: str | None = None
    replay_endpoint: str | None = None


class ProcessGroup:
    """Processes of one test (or module); :meth:`close` stops every one of them by PID."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[ManagedProcess] = []

    def _log(self, name: str) -> Path:
        return self.workdir / f"{name}-{len(self.procs)}.log"

    def worker(
        self,
        name: str,
        *,
        role: str = "both",
        model: str = "sim",
        events: bool = False,
        secret: str = "",
        api_key: str = "",
        args: Sequence[str] = (),
        wait: bool = True,
    ) -> WorkerProcess:
        """A ``python -m kvtier.worker`` process on free ports (HTTP, P2P, events)."""
        port = free_port()
        p2p_port = free_port() if role in ("producer", "both") else 0
        argv = [
            sys.executable, "-m", "kvtier.worker",
            "--role", role, "--model", model,
            "--port", str(port), "--log-level", "warning",
            "--engine-id", name,
            "--num-pages", "256", "--host-pages", "256",
            "--max-model-len", "2048", "--torch-threads", "1",
            "--fetch-timeout-s", "5", "--supply-lease-s", "20",
        ]  # fmt: skip
        if p2p_port:
            argv += ["--p2p-port", str(p2p_port)]
        events_endpoint = replay = None
        if events:
            events_endpoint = f"tcp://127.0.0.1:{free_port()}"
            replay = f"tcp://127.0.0.1:{free_port()}"
            argv += ["--events-endpoint", events_endpoint, "--events-replay-endpoint", replay]
        argv += list(args)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "PDPROXY_"))}
        if secret:
            env["KVTIER_P2P_SECRET"] = secret
        if api_key:  # in the environment, as in production (argv is world-readable)
            env["KVTIER_WORKER_API_KEY"] = api_key
        proc = WorkerProcess(
            name=name,
            argv=argv,
            log_path=self._log(name),
            url=f"http://127.0.0.1:{port}",
            role=role,
            p2p_port=p2p_port,
            events_endpoint=events_endpoint,
            replay_endpoint=replay,
        )
        proc.launch(env)
        self.procs.append(proc)
        if wait:
            proc.wait_healthy()
        return proc

    def proxy(self, name: str, config: dict[str, Any], *, wait: bool = True) -> ManagedProcess:
        """``python -m pdproxy.cli serve --config FILE`` with ``config`` (port filled in)."""
        port = free_port()
        # The scenarios read /metrics right after what they count: no answer from the merge
        # cache of a --workers group (metrics_cache_s, up to a second old by default).
        config = {
            "host": "127.0.0.1", "port": port, "log_level": "warning", "metrics_cache_s": 0,
            **config,
        }  # fmt: skip
        path = self.workdir / f"{name}-{len(self.procs)}.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        argv = [sys.executable, "-m", "pdproxy.cli", "serve", "--config", str(path)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "PDPROXY_"))}
        proc = ManagedProcess(name, argv, self._log(name), url=f"http://127.0.0.1:{port}")
        proc.launch(env)
        self.procs.append(proc)
        if wait:
            proc.wait_healthy("/health")
        return proc

    def command(self, name: str, argv: Sequence[str], url: str = "") -> ManagedProcess:
        """Any other helper process (a fake backend, a TCP fault relay)."""
        proc = ManagedProcess(name, list(argv), self._log(name), url=url)
        proc.launch()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        errors: list[str] = []
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{proc.name}: {exc}")
        self.procs.clear()
        if errors:
            raise ProcessStartError("could not stop: " + "; ".join(errors))
