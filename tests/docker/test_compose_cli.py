"""The compose files as the real Compose CLIs read them (v1 ``docker-compose`` 1.29 refuses a
top-level ``name:``, for one); no engine needed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from tests.docker.conftest import DOCKER, REQUIRED_SECRETS


def _clis() -> list[list[str]]:
    found = []
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    if shutil.which("docker"):
        v2 = subprocess.run(
            ["docker", "compose", "version"], capture_output=True, text=True, check=False
        )
        if v2.returncode == 0:
            found.append(["docker", "compose"])
    return found


@pytest.mark.parametrize("name", ["compose.yaml", "compose.vllm.yaml"])
def test_every_installed_compose_accepts_the_file(name: str) -> None:
    clis = _clis()
    if not clis:
        pytest.skip("no Compose CLI installed (docker/engine setup installs docker-compose)")
    env = {**os.environ, **REQUIRED_SECRETS[name]}
    for cli in clis:
        for profile in ([], ["--profile", "grafana"]):
            out = subprocess.run(
                [*cli, "-f", str(DOCKER / name), *profile, "config", "-q"],
                capture_output=True, text=True, timeout=60, env=env, check=False,
            )  # fmt: skip
            assert out.returncode == 0, (cli, profile, out.stderr)


def test_the_gpu_overlay_merges_onto_the_vllm_layout() -> None:
    clis = _clis()
    if not clis:
        pytest.skip("no Compose CLI installed (docker/engine setup installs docker-compose)")
    env = {**os.environ, **REQUIRED_SECRETS["compose.vllm.yaml"]}
    files = ["-f", str(DOCKER / "compose.vllm.yaml"), "-f", str(DOCKER / "compose.vllm.gpu.yaml")]
    for cli in clis:
        out = subprocess.run(
            [*cli, *files, "config"], capture_output=True, text=True, timeout=60, env=env,
            check=False,
        )  # fmt: skip
        assert out.returncode == 0, (cli, out.stderr)
        merged = yaml.safe_load(out.stdout)["services"]
        for engine, gpu in (("prefill-0", "0"), ("decode-0", "1")):
            [device] = merged[engine]["deploy"]["resources"]["reservations"]["devices"]
            assert device["device_ids"] == [gpu] and device["capabilities"] == ["gpu"]
            assert merged[engine]["command"][0] == "Qwen/Qwen2.5-0.5B-Instruct"  # kept
