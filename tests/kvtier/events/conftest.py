"""Fixtures of the KV event tests: CURVE key files written the way operators write them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvtier.events.curve import (
    CurveClient,
    CurveServer,
    load_client,
    load_server,
    write_certificate,
)


@dataclass(frozen=True)
class CurveFiles:
    """A worker's server pair and one admitted proxy's client pair, on disk."""

    server_public: Path
    server_secret: Path
    clients_dir: Path
    client_secret: Path

    def server(self) -> CurveServer:
        return load_server(self.server_secret, self.clients_dir)

    def client(self) -> CurveClient:
        return load_client(self.client_secret, self.server_public)


def write_curve_files(root: Path) -> CurveFiles:
    server_public, server_secret = write_certificate(root / "worker", "worker")
    clients = root / "clients"
    _, client_secret = write_certificate(root / "proxy", "proxy")
    clients.mkdir()
    (clients / "proxy.key").write_bytes((root / "proxy" / "proxy.key").read_bytes())
    return CurveFiles(server_public, server_secret, clients, client_secret)


@pytest.fixture
def curve_files(tmp_path: Path) -> CurveFiles:
    return write_curve_files(tmp_path / "curve")


@dataclass(frozen=True)
class Keys:
    """Constructor arguments for a publisher (``pub``) and its subscribers (``sub``)."""

    pub: dict[str, Any] = field(default_factory=dict)
    sub: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(params=["plain", "curve"])
def keys(request: pytest.FixtureRequest, tmp_path: Path) -> Keys:
    """Each pub/sub scenario runs without keys and with CURVE keys."""
    if request.param == "plain":
        return Keys()
    files = write_curve_files(tmp_path / "curve")
    return Keys(pub={"curve": files.server()}, sub={"curve": files.client()})
