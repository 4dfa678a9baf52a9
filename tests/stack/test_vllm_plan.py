"""``pdproxy up --engine vllm``'s plan: vLLM command lines, the proxy config they feed, and what
happens when the vLLM setup is missing. No vLLM needed (tests/vllm runs the real thing)."""

from __future__ import annotations

import itertools
import json
import stat
from pathlib import Path

import pytest

from pdproxy.settings import ProxySettings
from pdproxy.stack.cli import main as up_main
from pdproxy.stack.plan import StackOptions
from pdproxy.stack.vllm_engine import NIXL_KV_LEASE_S, SERVED_NAME, VLLM_BLOCK_SIZE, VllmPaths
from pdproxy.stack.vllm_plan import build_vllm_plan


def _installed(root: Path) -> VllmPaths:
    venv, model = root / "venv", root / "model"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".installed").write_text("stamp\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    return VllmPaths(venv, model)


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_instances_and_proxy_config(tmp_path: Path) -> None:
    paths = _installed(tmp_path)
    ports = itertools.count(30000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = StackOptions(producers=1, consumers=2)
    plan = build_vllm_plan(options, paths, run_dir, lambda: next(ports))
    assert [w.name for w in plan.workers] == ["p0", "c0", "c1"]
    assert plan.model_name == SERVED_NAME
    side_channels = set()
    for worker in plan.workers:
        argv = worker.argv
        assert argv[0] == str(paths.python) and argv[1] == "-c"
        assert argv[3:5] == ("serve", str(paths.model_dir))
        assert _flag(argv, "--host") == "127.0.0.1"  # HTTP on loopback only
        assert _flag(argv, "--block-size") == str(VLLM_BLOCK_SIZE)
        assert "--enable-prompt-tokens-details" in argv
        transfer = json.loads(_flag(argv, "--kv-transfer-config"))
        assert transfer == {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if worker.role == "producer" else "kv_consumer",
            "kv_buffer_device": "cpu",
            # Past a first UCX handshake on loaded CPUs (see NIXL_KV_LEASE_S).
            "kv_connector_extra_config": {"kv_lease_duration": NIXL_KV_LEASE_S},
        }
        events = json.loads(_flag(argv, "--kv-events-config"))
        assert events["endpoint"] == plan.events[worker.name]
        # ipc:// makes vLLM bind (it connects for a concrete TCP address).
        assert events["endpoint"].startswith("ipc://" + str(run_dir / "sockets"))
        assert events["replay_endpoint"].startswith("ipc://")
        assert worker.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        side_channels.add(worker.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    assert len(side_channels) == 3

    settings = ProxySettings.model_validate(plan.proxy_config)
    assert {b.dialect for b in settings.backends} == {"nixl"}
    assert {b.name: b.role for b in settings.backends} == {
        "p0": "producer",
        "c0": "consumer",
        "c1": "consumer",
    }
    router = plan.proxy_config["router_options"]
    assert router["block_size"] == VLLM_BLOCK_SIZE
    assert router["tokenizer"] == {"kind": "hf", "path": str(paths.model_dir)}


def test_event_sockets_are_private_to_this_user(tmp_path: Path) -> None:
    """KV events carry prompt token ids: another local user must not reach the socket files."""
    paths = _installed(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    build_vllm_plan(StackOptions(), paths, run_dir, iter(range(31000, 32000)).__next__)
    mode = stat.S_IMODE((run_dir / "sockets").stat().st_mode)
    assert mode & 0o077 == 0


def test_missing_or_impossible_setup_is_explained(tmp_path: Path) -> None:
    missing = VllmPaths(tmp_path / "nope", tmp_path / "nope" / "model")
    assert "scripts/dev vllm-setup" in (missing.problem() or "")
    with pytest.raises(ValueError, match="vllm-setup"):
        build_vllm_plan(StackOptions(), missing, tmp_path)

    paths = _installed(tmp_path)
    (paths.venv / ".unsupported").write_text("no wheels for aarch64\n")
    assert paths.problem() == "vLLM cannot run on this machine: no wheels for aarch64"

    no_model = VllmPaths(_installed(tmp_path / "other").venv, tmp_path / "absent")
    assert "no model" in (no_model.problem() or "")


def test_paths_come_from_flags_then_environment(tmp_path: Path) -> None:
    env = {"PDPROXY_VLLM_VENV": str(tmp_path / "v"), "PDPROXY_VLLM_MODEL_DIR": str(tmp_path / "m")}
    assert VllmPaths.resolve(environ=env) == VllmPaths(tmp_path / "v", tmp_path / "m")
    only_venv = VllmPaths.resolve(environ={"PDPROXY_VLLM_VENV": str(tmp_path / "v")})
    assert only_venv.model_dir == tmp_path / "v" / "models" / "tiny-llama"
    flags = VllmPaths.resolve(tmp_path / "x", tmp_path / "y", environ=env)
    assert flags == VllmPaths(tmp_path / "x", tmp_path / "y")


def test_up_without_the_setup_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = up_main(["--engine", "vllm", "--vllm-venv", str(tmp_path / "none"), "--port", "0",
                    "--run-dir", str(tmp_path / "run")])  # fmt: skip
    assert code == 2
    assert "scripts/dev vllm-setup" in capsys.readouterr().out


def test_data_parallel_ranks(tmp_path: Path) -> None:
    """``--data-parallel-size 2``: vLLM's flag, its events on loopback TCP (vLLM 0.32 refuses
    ``ipc://`` for rank 1) with the proxy listening (vLLM's PUB connects to a concrete address),
    runs of ports for the ranks, and the backend routed per rank."""
    paths = _installed(tmp_path)
    ports = itertools.count(30000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = StackOptions(producers=1, consumers=1, data_parallel_size=2)
    plan = build_vllm_plan(options, paths, run_dir, lambda: next(ports))
    settings = ProxySettings.model_validate(plan.proxy_config)
    assert settings.workers == 1  # one process listens where the ranks publish
    with pytest.raises(ValueError, match="workers: 1"):
        ProxySettings.model_validate({**plan.proxy_config, "workers": 2})
    by_name = {b.name: b for b in settings.backends}
    for worker in plan.workers:
        argv = worker.argv
        assert _flag(argv, "--data-parallel-size") == "2"
        events = json.loads(_flag(argv, "--kv-events-config"))
        assert events["endpoint"].startswith("tcp://127.0.0.1:")
        assert events["replay_endpoint"].startswith("tcp://127.0.0.1:")
        backend = by_name[worker.name]
        assert backend.data_parallel_size == 2 and backend.events_listen
        assert backend.events_endpoint == events["endpoint"]
        assert backend.events_replay_endpoint == events["replay_endpoint"]
    assert up_main(["--engine", "vllm", "--data-parallel-size", "2", "--connector", "kvtier",
                    "--vllm-venv", str(paths.venv), "--vllm-model", str(paths.model_dir),
                    "--run-dir", str(tmp_path / "k")]) != 0  # fmt: skip
