"""Fixtures of the membership tests: a real dnsmasq, CURVE key files for registration."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.events.curve import write_certificate
from tests.conftest import free_port
from tests.pdproxy.fleet.membership.dnsmasq import Dnsmasq


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    """A dnsmasq on a free loopback port (started by the test once its records are set)."""
    workdir = tmp_path / "dnsmasq"
    workdir.mkdir()
    server = Dnsmasq(workdir, free_port())
    yield server
    server.stop()


@dataclass(frozen=True)
class RegistrationKeys:
    proxy_secret: Path
    proxy_public: Path
    clients_dir: Path
    worker_secret: Path
    """An admitted worker's secret certificate."""
    stranger_secret: Path
    """A key pair the proxy does not admit."""


@pytest.fixture
def registration_keys(tmp_path: Path) -> RegistrationKeys:
    keys = tmp_path / "keys"
    clients = tmp_path / "clients"
    proxy_public, proxy_secret = write_certificate(keys, "proxy")
    worker_public, worker_secret = write_certificate(keys, "worker")
    _, stranger_secret = write_certificate(keys, "stranger")
    clients.mkdir()
    (clients / "worker.key").write_text(worker_public.read_text())
    return RegistrationKeys(proxy_secret, proxy_public, clients, worker_secret, stranger_secret)
