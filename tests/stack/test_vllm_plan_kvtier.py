"""``pdproxy up --engine vllm --connector kvtier``'s plan: every instance loads kvtier's vLLM
connector, the proxy speaks the p2p dialect, and the P2P secret stays off command lines. No
vLLM needed (tests/vllm/connector runs the real thing)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from pdproxy.settings import ProxySettings
from pdproxy.stack.plan import StackOptions
from pdproxy.stack.ports import non_ephemeral_range
from pdproxy.stack.vllm_engine import PACKAGES_ROOT, VllmConnector, VllmPaths
from pdproxy.stack.vllm_plan import build_vllm_plan


def _installed(root: Path) -> VllmPaths:
    venv, model = root / "venv", root / "model"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".installed").write_text("stamp\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    return VllmPaths(venv, model)


def test_kvtier_connector_plan(tmp_path: Path) -> None:
    paths = _installed(tmp_path)
    ports = itertools.count(30000)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = build_vllm_plan(
        StackOptions(producers=1, consumers=2),
        paths,
        run_dir,
        lambda: next(ports),
        connector=VllmConnector.KVTIER,
    )
    p2p_ports = {}
    secrets = set()
    for worker in plan.workers:
        argv = worker.argv
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "KvtierConnector"
        assert transfer["kv_connector_module_path"] == "kvtier.vllm.connector"
        assert transfer["kv_role"] == "kv_both"
        assert transfer["kv_load_failure_policy"] == "recompute"
        extra = transfer["kv_connector_extra_config"]
        assert extra["p2p_host"] == "127.0.0.1"  # P2P on loopback only
        p2p_ports[worker.name] = extra["p2p_port"]
        # The secret reaches vLLM through its environment, never its command line (ps shows
        # command lines to every local user).
        secret = worker.env["KVTIER_P2P_SECRET"]
        assert len(secret) >= 32 and not any(secret in arg for arg in argv)
        secrets.add(secret)
        assert worker.env["PYTHONPATH"] == str(PACKAGES_ROOT)
        assert (PACKAGES_ROOT / "kvtier" / "vllm" / "connector.py").is_file()
        assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in worker.env
    assert len(set(p2p_ports.values())) == 3
    assert len(secrets) == 1  # one trust domain per stack

    settings = ProxySettings.model_validate(plan.proxy_config)
    assert {b.dialect for b in settings.backends} == {"p2p"}
    kv_address = {b.name: b.kv_address for b in settings.backends}
    assert kv_address == {"p0": f"127.0.0.1:{p2p_ports['p0']}", "c0": None, "c1": None}


def test_every_run_has_its_own_secret(tmp_path: Path) -> None:
    paths = _installed(tmp_path)
    seen = set()
    for i in range(2):
        run_dir = tmp_path / f"run{i}"
        run_dir.mkdir()
        plan = build_vllm_plan(
            StackOptions(),
            paths,
            run_dir,
            iter(range(31000 + 100 * i, 32000)).__next__,
            connector=VllmConnector.KVTIER,
        )
        seen.add(plan.workers[0].env["KVTIER_P2P_SECRET"])
    assert len(seen) == 2


def test_up_takes_the_connector_flag() -> None:
    import argparse

    from pdproxy.stack.cli import add_up_arguments

    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    assert parser.parse_args(["--engine", "vllm"]).connector == "nixl"
    args = parser.parse_args(["--engine", "vllm", "--connector", "kvtier"])
    assert VllmConnector(args.connector) is VllmConnector.KVTIER


def test_p2p_ports_come_from_below_the_ephemeral_range(tmp_path: Path) -> None:
    """vLLM's own sockets take ephemeral ports while it starts; a P2P port named before the
    worker binds it must not be one of those, nor one promised to another instance."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = build_vllm_plan(
        StackOptions(producers=2, consumers=2),
        _installed(tmp_path),
        run_dir,
        connector=VllmConnector.KVTIER,
    )
    low, high = non_ephemeral_range(_ephemeral_range())
    p2p = []
    for worker in plan.workers:
        transfer = json.loads(worker.argv[worker.argv.index("--kv-transfer-config") + 1])
        p2p.append(transfer["kv_connector_extra_config"]["p2p_port"])
    assert len(set(p2p)) == 4
    assert all(low <= port <= high for port in p2p)


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)
