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

_VAR = re.compile(
    r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)"
)


class MissingVariable(Exception):
    """``${X:?message}`` with X unset or empty (``${X?message}``: unset): compose refuses to
    start and prints ``message``."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (``${X}``, ``${X:-default}``, ``${X-default}``,
    ``${X:?err}``, ``${X?err}``, ``$X``, ``$$``)."""
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name = m.group(1) or m.group(4)
            op, arg = m.group(2), m.group(3)
            got = env.get(name)
            missing = got is None or (got == "" and op is not None and op.startswith(":"))
            if op is not None and op.endswith("?") and missing:
                raise MissingVariable(f"required variable {name} is missing a value: {arg}")
            if not missing:
                return got or ""
            return arg if op is not None and op.endswith("-") else ""

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


REQUIRED_SECRETS = {
    "compose.yaml": {"KVTIER_P2P_SECRET": "p2p-" + "a" * 32, "KVTIER_WORKER_API_KEY": "k" * 32},
    "compose.vllm.yaml": {"VLLM_API_KEY": "v" * 32},
}
"""Values for the secrets each file requires (a real deployment sets its own)."""


def load_compose(
    name: str, env: dict[str, str] | None = None, *, secrets: bool = True
) -> dict[str, Any]:
    """The file as compose reads it; ``secrets`` supplies the required secrets (as an operator
    must), so checks that are not about them see a file that starts."""
    doc = yaml.safe_load((DOCKER / name).read_text())
    assert isinstance(doc, dict)
    given = {**(REQUIRED_SECRETS.get(name, {}) if secrets else {}), **(env or {})}
    return interpolate(doc, given)


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
