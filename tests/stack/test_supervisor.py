from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdproxy.stack.cli import serve_stack
from pdproxy.stack.display import StatusBoard
from pdproxy.stack.errors import ProcessExited, StartupFailed
from pdproxy.stack.plan import StackOptions, StackPlan
from pdproxy.stack.supervisor import ProcessStatus, Supervisor
from tests.stack.conftest import pid_alive, toy_spec, wait_gone

HERE = Path(__file__).parent


def test_starts_waits_healthy_reports_and_stops_everything(tmp_path: Path) -> None:
    specs = [toy_spec("a", "--delay", "0.3"), toy_spec("b")]
    with Supervisor(tmp_path) as sup:
        sup.start(specs)
        pids = [c.pid for c in sup.children]
        sup.wait_healthy(20)
        statuses = sup.statuses()
        assert [(s.name, s.running, s.healthy) for s in statuses] == [
            ("a", True, True),
            ("b", True, True),
        ]
        assert statuses[0].detail.startswith("status=ok port=")
        sup.check_running()
        exits = sup.stop()
    assert {e.name for e in exits} == {"a", "b"}
    assert [e.name for e in exits] == ["b", "a"]  # last started stops first
    assert not any(e.killed for e in exits)
    assert wait_gone(pids, 1) == []
    assert (tmp_path / "a.log").read_text().startswith("toy service on")


def test_a_process_that_exits_during_startup_fails_startup_with_its_log(tmp_path: Path) -> None:
    specs = [toy_spec("ok"), toy_spec("bad", "--exit-after", "0")]
    with Supervisor(tmp_path) as sup:
        sup.start(specs)
        with pytest.raises(StartupFailed, match=r"bad exited with code 3") as info:
            sup.wait_healthy(20)
        assert "toy service giving up" in str(info.value)
        pids = [c.pid for c in sup.children]
    assert wait_gone(pids, 1) == []


def test_never_healthy_times_out_naming_the_process(tmp_path: Path) -> None:
    specs = [toy_spec("slow", "--delay", "30")]
    with Supervisor(tmp_path, stop_grace_s=2) as sup:
        sup.start(specs)
        t0 = time.monotonic()
        with pytest.raises(StartupFailed, match="not healthy after 1 s: slow"):
            sup.wait_healthy(1)
        assert time.monotonic() - t0 < 5


def test_sigterm_ignored_means_sigkill_of_the_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    spec = toy_spec("stubborn", "--ignore-term", "--grandchild", "--pid-file", str(pid_file))
    with Supervisor(tmp_path, stop_grace_s=0.5) as sup:
        sup.start([spec])
        sup.wait_healthy(20)
        grandchild = int(pid_file.read_text())
        assert pid_alive(grandchild)
        exits = sup.stop()
    assert exits[0].killed and exits[0].returncode == -9
    assert wait_gone([exits[0].pid, grandchild], 5) == []


def test_a_process_dying_while_serving_is_reported(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        sup.start([toy_spec("short", "--exit-after", "0.5")])
        sup.wait_healthy(20)
        deadline = time.monotonic() + 10
        with pytest.raises(ProcessExited, match=r"short \(pid \d+\) exited with code 3"):
            while time.monotonic() < deadline:
                sup.check_running()
                time.sleep(0.05)
        assert sup.statuses()[0].detail == "exited 3"


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as sup:
        sup.start([toy_spec("x")])
        with pytest.raises(ValueError, match="unique"):
            sup.start([toy_spec("x")])


def _toy_plan(tmp_path: Path) -> StackPlan:
    proxy = toy_spec("proxy", role="proxy")
    return StackPlan(
        options=StackOptions(),
        workers=(toy_spec("p0", role="producer"), toy_spec("c0", role="consumer")),
        proxy=proxy,
        proxy_config={},
        config_path=tmp_path / "proxy.yaml",
        endpoint="http://127.0.0.1:1",
        model_name="toy-model",
    )


def test_serve_stack_prints_banner_writes_ready_file_and_stops(tmp_path: Path) -> None:
    plan = _toy_plan(tmp_path)
    stop = threading.Event()
    ready = tmp_path / "ready.json"
    out = io.StringIO()

    def stop_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        stop.set()

    watcher = threading.Thread(target=stop_when_ready)
    watcher.start()
    try:
        code = serve_stack(
            plan,
            tmp_path / "logs",
            stop=stop,
            startup_timeout_s=30,
            status_interval_s=0.1,
            ready_file=ready,
            out=out,
        )
    finally:
        stop.set()
        watcher.join()
    assert code == 0
    text = out.getvalue()
    assert "PD stack ready: http://127.0.0.1:1" in text
    assert "curl -sN http://127.0.0.1:1/v1/chat/completions" in text and "toy-model" in text
    assert "status " in text and "healthy" in text
    pids = json.loads(ready.read_text())["pids"]
    assert set(pids) == {"p0", "c0", "proxy"}
    assert wait_gone(list(pids.values()), 1) == []
    assert "stopping" in text


def test_serve_stack_returns_1_and_stops_all_when_a_process_dies(tmp_path: Path) -> None:
    plan = _toy_plan(tmp_path)
    dying = toy_spec("c1", "--exit-after", "0.5", role="consumer")
    plan = StackPlan(
        options=plan.options,
        workers=(*plan.workers, dying),
        proxy=plan.proxy,
        proxy_config={},
        config_path=plan.config_path,
        endpoint=plan.endpoint,
        model_name="toy-model",
    )
    out = io.StringIO()
    code = serve_stack(
        plan,
        tmp_path / "logs",
        stop=threading.Event(),
        startup_timeout_s=30,
        status_interval_s=0.1,
        ready_file=None,
        out=out,
    )
    assert code == 1
    assert "error: c1" in out.getvalue() and "exited with code 3" in out.getvalue()


def _start_toy_stack(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], dict[str, int]]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "toy_stack.py"), str(ready), str(tmp_path), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"toy stack did not get ready: {out}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["pids"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_stops_every_process_it_started(tmp_path: Path, sig: signal.Signals) -> None:
    grandchild_file = tmp_path / "gc.pid"
    proc, pids = _start_toy_stack(tmp_path, str(grandchild_file))
    grandchild = int(grandchild_file.read_text())
    proc.send_signal(sig)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert wait_gone([*pids.values(), grandchild], 5) == [], out
    assert "stopping" in out


def test_sigint_while_starting_stops_everything_without_error(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "toy_stack.py"), str(tmp_path / "ready.json"),
         str(tmp_path), "--slow"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    logs = tmp_path / "logs"
    deadline = time.monotonic() + 30
    while not (logs / "c0.log").exists() or not (logs / "c0.log").read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert "error" not in out and "stopping" in out
    pids = [int(line.split()[2]) for line in out.splitlines() if " pid " in line and "exit" in line]
    assert len(pids) == 2 and wait_gone(pids, 5) == []
    assert not (tmp_path / "ready.json").exists()


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    proc, pids = _start_toy_stack(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert wait_gone(list(pids.values()), 10) == []


def test_status_board_prints_on_change_without_a_terminal(tmp_path: Path) -> None:
    out = io.StringIO()
    board = StatusBoard(out, redraw=False)
    with Supervisor(tmp_path) as sup:
        sup.start([toy_spec("a")])
        sup.wait_healthy(20)
        board.show(sup.statuses())
        board.show(sup.statuses())
    assert out.getvalue().count("status ") == 1
    tty = io.StringIO()
    board = StatusBoard(tty, redraw=True)
    rows = [ProcessStatus("a", "proxy", 1, True, True, "")]
    board.show(rows)
    board.show(rows)
    assert "\x1b[2F" in tty.getvalue()  # second draw moves up over the first block
