"""docker/compose.yaml started for real: build once, up, the official openai SDK, a repeated long
prompt served from the holder's cache, Locust with no failure, Prometheus scraping every target,
then ``down`` leaves no container, network or volume behind.

Runs under ``scripts/dev test`` (CI) on a machine where a Docker engine can start; skips with
the reason elsewhere (see tests/docker/engine.py).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.docker.engine import (
    ROOT,
    Engine,
    build_images,
    compose_command,
    start_engine,
    stop_engine,
)
from tests.ops.promql import (
    Prometheus,
    check,
    dashboard_expressions,
    recorded_names,
    rule_expressions,
)

# The first test also pays for the images (about 5 minutes on a fresh machine: debootstrap, pip).
pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.timeout(1500)]

SERVICES = ["redis", "producer-0", "producer-1", "consumer-0", "consumer-1", "proxy", "prometheus"]


@dataclass
class LiveStack:
    engine: Engine
    compose: list[str]
    env: dict[str, str]
    project: str
    proxy_url: str
    prometheus_url: str
    before: dict[str, set[str]]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.compose, "-f", str(ROOT / "docker" / "compose.yaml"), "-p", self.project, *args],
            capture_output=True, text=True, timeout=timeout, env=self.env, check=False,
        )  # fmt: skip

    def down(self) -> subprocess.CompletedProcess[str]:
        return self.run("down", "--volumes", "--remove-orphans", "--timeout", "20")


def _inventory(engine: Engine) -> dict[str, set[str]]:
    return {
        "containers": set(engine.docker("ps", "-aq").split()),
        "networks": set(engine.docker("network", "ls", "-q").split()),
        "volumes": set(engine.docker("volume", "ls", "-q").split()),
    }


@pytest.fixture(scope="module")
def stack() -> Iterator[LiveStack]:
    engine = start_engine()
    try:
        compose = compose_command(engine)
        images = build_images(engine)
        env = {
            **engine.env(),
            **images,
            "KVTIER_P2P_SECRET": secrets.token_hex(32),
            "KVTIER_WORKER_API_KEY": secrets.token_hex(32),
            "PROXY_PORT": str(free_port()),
            "LOCUST_PORT": str(free_port()),
            "PROMETHEUS_PORT": str(free_port()),
            "PROXY_DEBUG_HEADERS": "true",
        }
        live = LiveStack(
            engine=engine,
            compose=compose,
            env=env,
            project=f"pdproxy-test-{secrets.token_hex(4)}",
            proxy_url=f"http://127.0.0.1:{env['PROXY_PORT']}",
            prometheus_url=f"http://127.0.0.1:{env['PROMETHEUS_PORT']}",
            before=_inventory(engine),
        )
        try:
            up = live.run("up", "-d", *SERVICES)
            assert up.returncode == 0, up.stderr[-4000:]
            _wait_ready(live)
            yield live
        finally:
            live.down()
    finally:
        stop_engine(engine)


def _wait_ready(live: LiveStack, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(live.proxy_url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    logs = live.run("logs", "--tail", "30")
    pytest.fail(f"the proxy did not get ready in {timeout_s:.0f} s:\n{logs.stdout[-4000:]}")


def test_official_openai_sdk_chat(stack: LiveStack) -> None:
    client = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="kvtier-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert answer.choices[0].message.content
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_repeated_long_prompt_is_served_from_the_holders_cache(stack: LiveStack) -> None:
    client = openai.OpenAI(base_url=stack.proxy_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Summarise the shared context. " * 60}]
    routes = []
    cached = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model="kvtier-sim", messages=messages, max_tokens=4,  # type: ignore[arg-type]
            extra_headers={"x-pdproxy-debug": "1"},
        )  # fmt: skip
        answer = raw.parse()
        routes.append(json.loads(raw.headers["x-pdproxy-route"]))
        details = answer.usage.prompt_tokens_details if answer.usage else None
        cached.append(details.cached_tokens or 0 if details else 0)
        time.sleep(1)  # the first request's KV events reach the router
    assert cached[1] > 0, (cached, routes)
    assert routes[1].get("reason") != "load", routes


def test_locust_runs_a_bounded_load_without_failures(stack: LiveStack, tmp_path: Path) -> None:
    # Not /reports: the service mounts its own volume there, and the two mounts would race.
    tmp_path.chmod(0o777)  # the image's user (uid 10001) writes the report
    out = stack.run(
        "run", "--rm", "-v", f"{tmp_path}:/host-reports", "locust",
        "-f", "/app/loadtest/locustfile.py", "--headless", "-u", "4", "-r", "4", "-t", "15s",
        "--host", "http://proxy:8000", "--report-json", "/host-reports/locust.json",
        "--only-summary",
        timeout=240,
    )  # fmt: skip
    said = f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert (tmp_path / "locust.json").is_file(), said
    report = json.loads((tmp_path / "locust.json").read_text())
    assert report["completed"] > 0, said
    assert report.get("failed", 0) == 0 and out.returncode == 0, said


def test_prometheus_scrapes_the_proxy_and_every_worker(stack: LiveStack) -> None:
    api = Prometheus(stack.prometheus_url)
    deadline = time.monotonic() + 60
    while True:
        targets = api.targets()
        if len(targets) == 5 and all(t["health"] == "up" for t in targets):
            break
        assert time.monotonic() < deadline, targets
        time.sleep(1)
    assert api.query("sum(pdproxy_requests_total) > 0")  # the traffic above was scraped
    assert api.query("sum(kvtier_worker_finished_requests_total) > 0")
    assert set(api.rule_health().values()) == {"ok"}
    # The dashboard and the rules hold against the compose stack's own Prometheus too.
    verdicts = check(api, dashboard_expressions() + rule_expressions(), recorded_names())
    problems = [f"{v.expression.where}: {v.problem}" for v in verdicts if v.problem]
    assert not problems, "\n".join(problems)


def test_down_leaves_nothing_behind(stack: LiveStack) -> None:
    out = stack.down()
    assert out.returncode == 0, out.stderr[-3000:]
    after = _inventory(stack.engine)
    for kind, ids in after.items():
        assert ids <= stack.before[kind], f"{kind} left after down: {ids - stack.before[kind]}"
    labelled = stack.engine.docker(
        "ps", "-aq", "--filter", f"label=com.docker.compose.project={stack.project}"
    )
    assert not labelled.split()
