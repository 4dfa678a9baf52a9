"""System test: the local stack (sim workers) against a single-node run, then bounded load.

Starts ``python -m pdproxy.stack --model sim`` (what ``pdproxy up`` runs) and one
``--role both`` worker as the single-node reference, checks that completions and chat (stream
and non-stream) through the PD proxy equal the single node's outputs, runs the benchmark client
and Locust for a few seconds against the stack, and finally stops the stack with SIGINT and
checks that no process it started is left.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port
from tests.stack.conftest import pid_alive, wait_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MODEL = "kvtier-sim"
SYSTEM = "You are a terse assistant. Answer in one short sentence, please. " * 2
STACK_ARGS = ["--model", "sim", "--producers", "1", "--consumers", "2"]
PROMPTS = [
    SYSTEM + "What is the capital of France?",
    SYSTEM + "Name a prime number larger than ten.",
    "A prompt that shares nothing with the others and is long enough to fill blocks.",
]


@dataclass
class Stack:
    proc: subprocess.Popen[str]
    endpoint: str
    pids: dict[str, int]
    log: Path
    run_dir: Path

    def log_tails(self) -> str:
        """The last lines of every process log, for failure messages."""
        parts = []
        for path in sorted((self.run_dir / "logs").glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def _wait_file(path: Path, proc: subprocess.Popen[str], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
            pytest.fail(f"not ready (rc={proc.returncode}):\n{log.read_text()[-4000:]}")
        time.sleep(0.1)


@contextmanager
def _run_stack(tmp: Path, *args: str, status_interval: float = 0) -> Iterator[Stack]:
    ready, log = tmp / "ready.json", tmp / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdproxy.stack", *args, "--port", str(free_port()),
             "--run-dir", str(tmp / "run"), "--ready-file", str(ready),
             "--status-interval", str(status_interval), "--startup-timeout", "120"],
            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )  # fmt: skip
    try:
        _wait_file(ready, proc, log, 150)
        info = json.loads(ready.read_text())
        yield Stack(proc, info["endpoint"], info["pids"], log, tmp / "run")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with _run_stack(tmp_path_factory.mktemp("stack"), *STACK_ARGS) as running:
        yield running


@pytest.fixture(scope="module")
def single_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("single") / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.worker", "--role", "both", "--model", "sim",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"single-node worker did not start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _body(endpoint: str, prompt: str, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": stream}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _answer(client: httpx.Client, base: str, endpoint: str, prompt: str, stream: bool) -> str:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    body = _body(endpoint, prompt, stream)
    if not stream:
        resp = client.post(base + path, json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return str(choice["message"]["content"] if endpoint == "chat" else choice["text"])
    parts = []
    done = False
    with client.stream("POST", base + path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            for choice in json.loads(data)["choices"]:
                if endpoint == "chat":
                    parts.append(choice.get("delta", {}).get("content") or "")
                else:
                    parts.append(choice.get("text") or "")
    assert done
    return "".join(parts)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_pd_outputs_equal_single_node(
    stack: Stack, single_node: str, endpoint: str, stream: bool
) -> None:
    with httpx.Client(timeout=60) as client:
        for prompt in PROMPTS:
            expected = _answer(client, single_node, endpoint, prompt, stream)
            got = _answer(client, stack.endpoint, endpoint, prompt, stream)
            assert expected, "the single node generated nothing"
            assert got == expected, (endpoint, stream, prompt, stack.log_tails())
            # Twice: the second time the prefix is cached (and the router knows where).
            assert _answer(client, stack.endpoint, endpoint, prompt, stream) == expected


def test_workers_refuse_callers_without_the_runs_key(stack: Stack) -> None:
    """A local user who bypasses the proxy and calls a worker directly gets 401; the config
    that holds the key is readable by its owner only."""
    config_path = stack.run_dir / "proxy.yaml"
    assert config_path.stat().st_mode & 0o077 == 0
    assert (stack.run_dir / "admin_key").stat().st_mode & 0o077 == 0
    config = yaml.safe_load(config_path.read_text())
    # The stack's own output (here a log file) names the key file, never a key.
    up_log = stack.log.read_text()
    assert config["admin_key"] not in up_log and "admin_key)" in up_log
    assert all(b["api_key"] not in up_log for b in config["backends"])
    with httpx.Client(timeout=30) as client:
        for backend in config["backends"]:
            body = {"prompt": "x", "max_tokens": 1}
            resp = client.post(backend["url"] + "/v1/completions", json=body)
            assert resp.status_code == 401, resp.text
            release = {"kv_request_id": "any"}
            assert client.post(backend["url"] + "/v1/kv/release", json=release).status_code == 401
            assert client.get(backend["url"] + "/health").status_code == 200
            keyed = {"authorization": f"Bearer {backend['api_key']}"}
            resp = client.post(backend["url"] + "/v1/completions", json=body, headers=keyed)
            assert resp.status_code == 200, resp.text


def test_bench_client_runs_shared_prefix_against_the_stack(stack: Stack, tmp_path: Path) -> None:
    result = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_client", "--base-url", stack.endpoint,
         "--model", MODEL, "--workload", "shared-prefix", "--groups", "2",
         "--prompts-per-group", "4", "--system-prompt-len", "256", "--question-len", "32",
         "--output-len", "8", "--max-concurrency", "4", "--max-duration", "60",
         "--result-json", str(result)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + stack.log_tails()
    doc = json.loads(result.read_text())
    assert doc["completed"] == 8 and doc["failed"] == 0, (doc["errors"], stack.log_tails())
    assert doc["total_output_tokens"] == 8 * 8
    assert doc["mean_ttft_ms"] > 0 and doc["p99_itl_ms"] > 0


def test_bench_client_starts_and_stops_its_own_local_stack(tmp_path: Path) -> None:
    result = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench_client", "--local-stack",
         *(f"--stack-arg={a}" for a in STACK_ARGS), "--workload", "random", "--num-prompts", "4",
         "--input-len", "64", "--output-len", "4", "--max-duration", "30",
         "--result-json", str(result)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "local stack ready at http://127.0.0.1:" in proc.stdout
    doc = json.loads(result.read_text())
    assert doc["completed"] == 4 and doc["model_id"] == MODEL  # discovered via /v1/models


def test_locust_runs_against_the_stack(stack: Stack, tmp_path: Path) -> None:
    exe = shutil.which("locust", path=str(Path(sys.executable).parent))
    assert exe is not None
    report = tmp_path / "locust.json"
    proc = subprocess.run(
        [exe, "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u", "2",
         "-r", "2", "-t", "3s", "--host", stack.endpoint, "--only-summary",
         "--model", MODEL, "--workload", "multi-turn", "--conversations", "2", "--turns", "2",
         "--system-prompt-len", "64", "--question-len", "16", "--output-len", "6",
         "--report-json", str(report)],
        capture_output=True, text=True, timeout=90, cwd=tmp_path, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    doc = json.loads(report.read_text())
    assert doc["completed"] > 0 and doc["failed"] == 0, out + stack.log_tails()
    assert "TTFT" in out


def test_sigint_stops_every_process_of_the_stack(stack: Stack) -> None:
    assert all(pid_alive(pid) for pid in stack.pids.values())
    stack.proc.send_signal(signal.SIGINT)
    stack.proc.wait(60)
    assert stack.proc.returncode == 0, stack.log.read_text()[-3000:]
    assert wait_gone(list(stack.pids.values()), 10) == []
    text = stack.log.read_text()
    assert "PD stack ready" in text and "stopping" in text


@pytest.mark.redis
def test_stack_with_the_redis_index_serves_and_stops(redis_url: str, tmp_path: Path) -> None:
    with _run_stack(
        tmp_path, "--model", "sim", "--redis", redis_url, status_interval=0.2
    ) as running:
        with httpx.Client(timeout=60) as client:
            first = _answer(client, running.endpoint, "chat", PROMPTS[0], True)
            assert first and _answer(client, running.endpoint, "chat", PROMPTS[0], False) == first
        # The router keeps residency in Redis under the model's hash tag: per-block entries
        # (the prompt spans 8 blocks) besides a few bookkeeping keys.
        keys = [k for k in _redis_keys(redis_url) if k.startswith("{pdproxy:kvtier-sim/seed=0}:")]
        assert len(keys) > 8, keys
        # The live status shows what the proxy sees of each worker (its admin API).
        deadline = time.monotonic() + 10
        while "in_flight=0 routable" not in running.log.read_text():
            assert time.monotonic() < deadline, running.log.read_text()
            time.sleep(0.1)
        running.proc.send_signal(signal.SIGINT)
        running.proc.wait(60)
        assert running.proc.returncode == 0
        assert wait_gone(list(running.pids.values()), 10) == []
    config = (tmp_path / "run" / "proxy.yaml").read_text()
    assert redis_url in config


def _redis_keys(url: str) -> list[str]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return [bytes(k).decode(errors="replace") for k in client.keys("*")]
    finally:
        client.close()
