"""Compose files as the Docker engine would read them (no engine runs here)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.loadtest.conftest import fake_openai_url

__all__ = ["fake_openai_url"]

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (``${X}``, ``${X:-default}``, ``$X``, ``$$``)."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(3)
            default = m.group(2)
            got = env.get(name)
            if got:
                return got
            return default if default is not None else ""

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    doc = yaml.safe_load((DOCKER / name).read_text())
    assert isinstance(doc, dict)
    return interpolate(doc, env or {})


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No PDPROXY_/KVTIER_/LOCUST_ variables from the caller's shell leak into a check."""
    for key in list(os.environ):
        if key.startswith(("PDPROXY_", "KVTIER_", "LOCUST_")):
            monkeypatch.delenv(key)
    return monkeypatch
