"""Graceful shutdown of a real worker process on SIGTERM/SIGINT (slow)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.conftest import free_port

from .test_processes import start_worker, stop

pytestmark = pytest.mark.slow


def exit_status(proc: subprocess.Popen[bytes], within_s: float) -> int:
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running {within_s} s after the signal")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_an_idle_worker_with_status_0(sig: signal.Signals) -> None:
    events = f"tcp://127.0.0.1:{free_port()}"
    proc, _ = start_worker(
        "--role",
        "both",
        "--model",
        "tiny",
        "--p2p-port",
        str(free_port()),
        "--events-endpoint",
        events,
    )
    try:
        proc.send_signal(sig)
        assert exit_status(proc, 10) == 0
    finally:
        stop(proc)


def test_sigterm_aborts_in_flight_requests_within_the_bound() -> None:
    proc, url = start_worker(
        "--role",
        "both",
        "--model",
        "sim",
        "--sim-decode-ms-per-step",
        "50",
        "--shutdown-timeout-s",
        "1",
    )
    answers: list[httpx.Response | BaseException] = []

    def long_request() -> None:
        body = {"prompt": "a long answer", "max_tokens": 1000}  # ~50 s of decoding
        try:
            answers.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
        except httpx.HTTPError as exc:
            answers.append(exc)

    client = threading.Thread(target=long_request)
    try:
        client.start()
        deadline = time.monotonic() + 10
        while "kvtier_worker_running_requests 1.0" not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert exit_status(proc, 10) == 0
        assert time.monotonic() - started < 6
        client.join(10)
        assert not client.is_alive()
        [answer] = answers
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code == 503
        assert answer.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        stop(proc)
        client.join(30)
