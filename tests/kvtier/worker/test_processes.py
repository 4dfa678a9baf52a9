"""System tests with real worker processes started from the documented command (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow


def start_worker(*args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.worker",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--num-pages",
            "256",
            "--max-model-len",
            "2048",
            "--torch-threads",
            "1",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            pytest.fail(f"worker exited with {proc.returncode}: {err[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=0.5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    stop(proc)
    pytest.fail("worker did not become healthy within 60 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stderr is not None:
        proc.stderr.close()


@pytest.fixture
def pd_pair() -> Iterator[tuple[str, str]]:
    procs = []
    try:
        producer, p_url = start_worker(
            "--role",
            "producer",
            "--model",
            "tiny",
            "--p2p-port",
            str(free_port()),
            "--engine-id",
            "prod-1",
        )
        procs.append(producer)
        consumer, c_url = start_worker("--role", "both", "--model", "tiny")
        procs.append(consumer)
        yield p_url, c_url
    finally:
        for proc in procs:
            stop(proc)


def test_pd_across_processes_equals_single_node(pd_pair: tuple[str, str]) -> None:
    p_url, c_url = pd_pair
    prompt = "Real processes, real sockets, the same answer. " * 8
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    with httpx.Client(timeout=60) as client:
        nixl = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        produced = client.post(
            f"{p_url}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": nixl}
        ).json()
        params = produced["kv_transfer_params"]
        assert params["remote_engine_id"] == "prod-1"
        pd = client.post(f"{c_url}/v1/completions", json={**body, "kv_transfer_params": params})
        assert pd.status_code == 200
        assert pd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics = client.get(f"{c_url}/metrics").text
        assert "kvtier_worker_recomputed_tokens_total 0.0" in metrics
        assert "kvtier_worker_p2p_fetch_failures_total 0.0" in metrics
        # The consumer now holds the prompt itself; a fresh single-node run must agree.
        solo_proc, solo_url = start_worker("--role", "both", "--model", "tiny")
        try:
            solo = client.post(f"{solo_url}/v1/completions", json=body).json()
        finally:
            stop(solo_proc)
        assert pd.json()["choices"][0]["token_ids"] == solo["choices"][0]["token_ids"]


def test_client_disconnect_aborts_the_request() -> None:
    proc, url = start_worker("--role", "both", "--model", "sim", "--sim-decode-ms-per-step", "20")

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": "abort me", "max_tokens": 1000, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for _line in resp.aiter_lines():
                    break  # first chunk arrived; now go away
            for _ in range(100):
                metrics = (await client.get(f"{url}/metrics")).text
                if "kvtier_worker_aborted_requests_total 1.0" in metrics:
                    break
                await asyncio.sleep(0.05)
            assert "kvtier_worker_aborted_requests_total 1.0" in metrics
            assert "kvtier_worker_running_requests 0.0" in metrics
            body = {"prompt": "abort me too", "max_tokens": 1000}
            task = asyncio.create_task(client.post(f"{url}/v1/completions", json=body))
            await asyncio.sleep(0.3)
            task.cancel()  # a non-streaming client that goes away
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(100):
                metrics = (await client.get(f"{url}/metrics")).text
                if "kvtier_worker_aborted_requests_total 2.0" in metrics:
                    break
                await asyncio.sleep(0.05)
            assert "kvtier_worker_aborted_requests_total 2.0" in metrics

    try:
        asyncio.run(scenario())
    finally:
        stop(proc)
