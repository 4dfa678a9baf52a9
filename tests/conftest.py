"""Shared fixtures: a real redis-server on a free port, CUDA detection for the gpu marker."""

from __future__ import annotations

import faulthandler
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdproxy.stack.ports import free_port

__all__ = ["free_port"]


@dataclass
class RedisServer:
    """A redis-server this test session started; tests may stop and restart it."""

    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed; scripts/dev installs it")
        self.proc = subprocess.Popen(
            [
                exe,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--daemonize", "no",
                "--loglevel", "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        self.stop()
        pytest.fail("redis-server did not answer within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server stays connected but answers nothing (a 'slow' Redis)."""
        assert self.proc is not None
        self.proc.send_signal(19)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(18)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(port=free_port(), workdir=tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of a running, empty Redis (flushed before each test)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=2) as s:
        s.sendall(b"FLUSHALL\r\n")
        s.recv(16)
    yield redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server for one test alone, for tests that stop, pause or restart it."""
    server = RedisServer(port=free_port(), workdir=tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.resume()
        server.stop()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _cuda_available():
        skip = pytest.mark.skip(reason="needs CUDA; this machine has none")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# A test stuck in C (a libzmq lock, a blocking syscall retried on EINTR) never sees
# pytest-timeout's SIGALRM, and CI then stalls until its own wall-clock limit with no clue.
# faulthandler's watchdog is a C thread: past the test's timeout plus this grace it prints every
# thread's stack to the real stderr and ends the run.
HANG_GRACE_S = 120.0
_REAL_STDERR = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # Output capture is suspended while plugins configure, so fd 2 is the real stderr here.
    config.stash[_REAL_STDERR] = os.dup(2)


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_REAL_STDERR, None)
    if fd is not None:
        os.close(fd)
        del config.stash[_REAL_STDERR]


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    limit = _timeout_of(item)
    if limit > 0:
        faulthandler.dump_traceback_later(
            limit + HANG_GRACE_S, exit=True, file=item.config.stash[_REAL_STDERR]
        )
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
