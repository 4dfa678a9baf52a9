"""A Docker engine and Compose for the live stack tests (``docker/engine``, ``docker/images``).

Where no engine can start on the machine, ``docker/engine setup`` (run by ``scripts/dev test``)
says why in ``.docker-engine/unsupported`` and the tests skip with that reason; where it merely
was not set up they skip locally and fail under CI (``CI`` or ``PDPROXY_DOCKER_REQUIRED``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("PDPROXY_DOCKER_STATE") or ROOT / ".docker-engine")


def _fail_or_skip(reason: str) -> None:
    if os.environ.get("CI") or os.environ.get("PDPROXY_DOCKER_REQUIRED"):
        pytest.fail(f"{reason} (scripts/dev test runs docker/engine setup; it must have worked)")
    pytest.skip(reason)


@dataclass(frozen=True, slots=True)
class Engine:
    host: str
    started: bool
    """True when this session started the dockerd (and so stops it)."""

    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": self.host}

    def docker(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(
            ["docker", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
        )
        assert out.returncode == 0, f"docker {' '.join(args)}: {out.stderr[-2000:]}"
        return out.stdout


def start_engine() -> Engine:
    unsupported = STATE / "unsupported"
    if unsupported.is_file():
        pytest.skip(unsupported.read_text().strip())
    if shutil.which("docker") is None:
        _fail_or_skip("no docker client on this machine")
    had_pid = (STATE / "dockerd.pid").exists()
    out = subprocess.run(
        [str(ROOT / "docker" / "engine"), "start"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        _fail_or_skip(f"no Docker engine could start: {out.stderr[-1500:]}")
    started = not had_pid and (STATE / "dockerd.pid").exists()
    return Engine(host=out.stdout.strip().splitlines()[-1], started=started)


def stop_engine(engine: Engine) -> None:
    if engine.started:
        subprocess.run([str(ROOT / "docker" / "engine"), "stop"], timeout=60, check=False)


def compose_command(engine: Engine) -> list[str]:
    """Compose v2 (``docker compose``) where installed, else v1 (``docker-compose``)."""
    v2 = subprocess.run(
        ["docker", "compose", "version"],
        check=False,
        capture_output=True,
        text=True,
        env=engine.env(),
    )
    if v2.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    _fail_or_skip("neither Compose v2 nor docker-compose is installed")
    raise AssertionError("unreachable")


def build_images(engine: Engine) -> dict[str, str]:
    """``docker/images --local`` as root (debootstrap needs it); official images from a
    registry otherwise or with ``PDPROXY_DOCKER_IMAGES=registry``."""
    registry = os.environ.get("PDPROXY_DOCKER_IMAGES") == "registry" or os.geteuid() != 0
    args = [] if registry else ["--local"]
    out = subprocess.run(
        [str(ROOT / "docker" / "images"), *args],
        check=False, capture_output=True, text=True, timeout=1200, env=engine.env(),
    )  # fmt: skip
    assert out.returncode == 0, f"docker/images failed:\n{out.stderr[-4000:]}"
    return dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)
