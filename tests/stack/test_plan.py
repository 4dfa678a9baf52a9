"""The stack's plan, checked against the real CLIs and settings models it feeds."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from kvtier.worker.__main__ import parse_settings
from pdproxy.cli import build_parser, settings_from_args
from pdproxy.settings import ProxySettings
from pdproxy.stack.cli import build_parser as build_up_parser
from pdproxy.stack.cli import options_from_args
from pdproxy.stack.plan import StackDialect, StackOptions, WorkerModel, build_plan


def _ports() -> itertools.count[int]:
    return itertools.count(20000)


def test_workers_are_planned_with_the_worker_cli(tmp_path: Path) -> None:
    ports = _ports()
    options = StackOptions(producers=2, consumers=3, model=WorkerModel.SIM)
    plan = build_plan(options, tmp_path, lambda: next(ports))
    assert [w.name for w in plan.workers] == ["p0", "p1", "c0", "c1", "c2"]
    assert [s.name for s in plan.specs][-1] == "proxy"
    secrets = {w.env["KVTIER_WORKER_P2P_SECRET"] for w in plan.workers}
    assert len(secrets) == 1 and len(secrets.pop()) >= 32
    http_ports = set()
    for worker in plan.workers:
        assert worker.argv[:3] == (sys.executable, "-m", "kvtier.worker")
        settings, _ = parse_settings(list(worker.argv[3:]))
        assert settings.role == worker.role
        assert settings.model == "sim" and settings.model_name == plan.model_name
        assert worker.health_url == f"http://127.0.0.1:{settings.port}/health"
        assert settings.events_endpoint == plan.events[worker.name]
        assert settings.engine_id == worker.name
        http_ports.add(settings.port)
    assert len(http_ports) == 5


def test_proxy_config_is_valid_and_wires_every_worker(tmp_path: Path) -> None:
    ports = _ports()
    options = StackOptions(
        dialect=StackDialect.NIXL, redis_url="redis://127.0.0.1:6390/0", port=18000
    )
    plan = build_plan(options, tmp_path, lambda: next(ports))
    settings = ProxySettings(**plan.proxy_config)
    assert settings.router == "kv" and settings.port == 18000
    assert settings.admin_key is not None
    assert settings.admin_key.get_secret_value() == plan.admin_key and len(plan.admin_key) >= 32
    assert {b.name for b in settings.backends} == {"p0", "c0"}
    assert all(b.dialect == "nixl" for b in settings.backends)
    for backend, worker in zip(settings.backends, plan.workers, strict=True):
        assert worker.health_url == backend.url + "/health"
        assert backend.events_endpoint == plan.events[backend.name]
        assert backend.events_replay_endpoint is not None
        assert "--events-replay-endpoint" in worker.argv
        assert worker.argv[worker.argv.index("--events-replay-endpoint") + 1] == (
            backend.events_replay_endpoint
        )
        assert backend.role.value == worker.role
    router = settings.router_options
    assert router.index_url == "redis://127.0.0.1:6390/0"
    assert router.events == {} and router.replay == {}  # the backends announce their sockets
    assert router.model_seed == f"{plan.model_name}/seed=0" and router.block_size == 16
    # The proxy command is the real CLI's, and it reads the config file the plan names.
    args = build_parser().parse_args(list(plan.proxy.argv[3:]))
    assert plan.proxy.argv[1:3] == ("-m", "pdproxy.cli") and args.command == "serve"
    assert args.config == plan.config_path
    import yaml

    plan.config_path.write_text(yaml.safe_dump(plan.proxy_config))
    from_file = settings_from_args(args)
    assert from_file.backends == settings.backends and from_file.port == 18000
    assert plan.proxy.health_url == "http://127.0.0.1:18000/ready"
    assert plan.endpoint == "http://127.0.0.1:18000"


def test_memory_index_and_other_routers(tmp_path: Path) -> None:
    plan = build_plan(StackOptions(), tmp_path)
    assert "index_url" not in plan.proxy_config["router_options"]
    rr = build_plan(StackOptions(router="round_robin"), tmp_path)
    assert "router_options" not in rr.proxy_config
    assert ProxySettings(**rr.proxy_config).router == "round_robin"


def test_a_stack_needs_both_roles(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one producer and one consumer"):
        build_plan(StackOptions(producers=0), tmp_path)


def test_up_flags_map_to_options() -> None:
    args = build_up_parser().parse_args(
        ["--producers", "2", "--consumers", "3", "--model", "sim", "--dialect", "nixl",
         "--redis", "redis://r:6379/0", "--port", "9000", "--worker-arg=--sim-decode-ms-per-step",
         "--worker-arg=2"]
    )  # fmt: skip
    options = options_from_args(args)
    assert options == StackOptions(
        producers=2, consumers=3, model=WorkerModel.SIM, dialect=StackDialect.NIXL,
        redis_url="redis://r:6379/0", port=9000,
        worker_args=("--sim-decode-ms-per-step", "2"),
    )  # fmt: skip


def test_sim_latency_flags_reach_the_worker_cli(tmp_path: Path) -> None:
    args = build_up_parser().parse_args(
        ["--model", "sim", "--sim-prefill-ms-per-token", "0.5", "--sim-decode-ms-per-step", "4"]
    )
    plan = build_plan(options_from_args(args), tmp_path)
    settings, _ = parse_settings(list(plan.workers[0].argv[3:]))
    assert settings.sim_prefill_ms_per_token == 0.5 and settings.sim_decode_ms_per_step == 4.0


def test_up_registers_on_a_cli_with_a_handler() -> None:
    import argparse

    from pdproxy.stack import add_up_command
    from pdproxy.stack.cli import run_up

    parser = argparse.ArgumentParser()
    add_up_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["up", "--model", "sim"])
    assert args.handler is run_up and args.model == "sim" and args.producers == 1


def test_up_refuses_a_busy_port_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    from pdproxy.stack.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--port", str(port), "--model", "sim"]) == 2
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().out


def test_up_refuses_a_stack_without_consumers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdproxy.stack.cli import main

    assert main(["--consumers", "0", "--run-dir", str(tmp_path), "--port", "0"]) == 2
    assert "at least one producer and one consumer" in capsys.readouterr().out
    assert not (tmp_path / "logs").exists()


def test_proxy_view_describes_why_a_backend_is_not_routable() -> None:
    from pdproxy.stack.proxy_view import _describe

    assert _describe({"in_flight": 2, "routable": True}) == "in_flight=2 routable"
    down = {"in_flight": 0, "routable": False, "healthy": False, "breaker": "open"}
    assert _describe(down) == "in_flight=0 NOT ROUTABLE (unhealthy, breaker open)"


def test_data_parallel_ranks_of_reference_workers(tmp_path: Path) -> None:
    """Each worker runs two ranks (their events on the ports + rank, runs of free ports); the
    proxy routes per rank."""
    plan = build_plan(StackOptions(data_parallel_size=2), tmp_path)
    settings = ProxySettings.model_validate(plan.proxy_config)
    for worker, backend in zip(plan.workers, settings.backends, strict=True):
        argv = list(worker.argv)
        assert argv[argv.index("--data-parallel-size") + 1] == "2"
        assert backend.data_parallel_size == 2 and not backend.events_listen
    with pytest.raises(ValueError):
        build_plan(StackOptions(data_parallel_size=0), tmp_path)
