"""A real 3-master Redis Cluster on free loopback ports (``redis-server --cluster-enabled yes``
joined by ``redis-cli --cluster create``), for the cluster suites. Stopped by PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pdproxy.stack.ports import free_ports


def _wait_ping(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"redis-server on {port} did not answer")


def _cluster_ok(port: int) -> bool:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "cluster", "info"],
        capture_output=True, text=True, timeout=5, check=False,
    )  # fmt: skip
    return "cluster_state:ok" in out.stdout


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[str]:
    """Yield ``redis+cluster://127.0.0.1:PORT`` of a fresh cluster; stop it afterwards."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise RuntimeError("redis-server/redis-cli are not installed; scripts/dev installs them")
    every = free_ports(2 * masters)  # a client port and a cluster bus port per node
    ports, buses = every[:masters], every[masters:]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port, bus in zip(ports, buses, strict=True):
            d = workdir / str(port)
            d.mkdir(parents=True, exist_ok=True)
            argv = [
                exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-port", str(bus), "--cluster-config-file", str(d / "nodes.conf"),
                "--save", "", "--appendonly", "no", "--dir", str(d), "--loglevel", "warning",
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        deadline = time.monotonic() + 20
        for port, proc in zip(ports, procs, strict=True):
            _wait_ping(port, proc, deadline)
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, timeout=30, check=True,
        )  # fmt: skip
        while not all(_cluster_ok(p) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not become ready")
            time.sleep(0.1)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master cluster for the whole session (tests use namespaces of their own)."""
    try:
        with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as url:
            yield url
    except RuntimeError as exc:
        pytest.fail(str(exc))
