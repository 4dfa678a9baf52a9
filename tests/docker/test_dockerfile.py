"""docker/Dockerfile: pinned CPU torch by default, a CUDA base by build arg, real paths."""

from __future__ import annotations

import os
import re
import tomllib

import pytest
import yaml

from pdproxy.cli import build_parser, settings_from_args
from tests.docker.conftest import DOCKER, ROOT

TEXT = (DOCKER / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", TEXT)
    out = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG")


def test_torch_is_pinned_like_scripts_dev_and_cpu_by_default() -> None:
    args = _args()
    dev = (ROOT / "scripts" / "dev").read_text()
    pinned = re.search(r"TORCH_VERSION=\$\{TORCH_VERSION:-([0-9.]+)\}", dev)
    assert pinned is not None and args["TORCH_VERSION"] == pinned.group(1) == "2.13.0"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    runs = [rest for word, rest in _instructions() if word == "RUN"]
    torch_run = next(r for r in runs if '"torch==${TORCH_VERSION}"' in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run
    # The project install re-states the pin so no resolver swaps the build.
    assert any('.[worker,loadtest,otel]" "torch==${TORCH_VERSION}"' in r for r in runs)


def test_base_image_is_a_build_arg() -> None:
    froms = [rest for word, rest in _instructions() if word == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    assert _args()["BASE_IMAGE"].startswith("python:3.1")
    assert "cuda" in TEXT and "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu" in TEXT


def test_copied_paths_exist_are_not_ignored_and_extras_exist() -> None:
    copies = [rest.split() for word, rest in _instructions() if word == "COPY"]
    sources = [s.rstrip("/") for parts in copies for s in parts[:-1]]
    assert set(sources) >= {"pyproject.toml", "pdproxy", "kvtier", "loadtest"}
    # The legacy builder reads only the root .dockerignore; BuildKit the Dockerfile's: same rules.
    root_ignore = (ROOT / ".dockerignore").read_text().splitlines()
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules == [line for line in root_ignore if line and not line.startswith("#")]
    assert "!.venv" not in rules and rules[0] == "**"
    for src in sources:
        assert (ROOT / src).exists(), src
        assert f"!{src}" in ignore or f"!{src}/**" in ignore, src
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"worker", "loadtest"} <= set(extras)


def test_default_command_is_the_proxy_on_all_interfaces_with_backends_from_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cmd = next(rest for word, rest in _instructions() if word == "CMD")
    argv = yaml.safe_load(cmd)
    assert argv == ["pdproxy", "serve"]
    env = dict(
        rest.split("=", 1)
        for word, rest in _instructions()
        if word == "ENV" and "=" in rest and " " not in rest
    )
    assert env["PDPROXY_HOST"] == "0.0.0.0"  # not 127.0.0.1: nothing outside could reach it
    for key in list(os.environ):
        if key.startswith("PDPROXY_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PDPROXY_HOST", env["PDPROXY_HOST"])
    monkeypatch.setenv(
        "PDPROXY_BACKENDS",
        '[{"name": "d0", "url": "http://decode:8100", "role": "consumer"}]',
    )
    settings = settings_from_args(build_parser().parse_args(argv[1:]))
    assert settings.host == "0.0.0.0"
    assert [b.url for b in settings.backends] == ["http://decode:8100"]
