"""``pdproxy up`` secrets: fresh per run, only in environments and owner-only files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.private_file import is_private, write_private_text
from pdproxy.settings import ProxySettings
from pdproxy.stack.display import ready_banner
from pdproxy.stack.plan import StackOptions, admin_key_path, build_plan, write_proxy_config


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The most permissive umask: files are world-readable unless created otherwise."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_every_worker_gets_the_runs_key_and_the_proxy_sends_it(tmp_path: Path) -> None:
    plan = build_plan(StackOptions(producers=2, consumers=2), tmp_path)
    assert len(plan.worker_key) == 32
    settings = ProxySettings(**plan.proxy_config)
    for backend, worker in zip(settings.backends, plan.workers, strict=True):
        assert worker.env["KVTIER_WORKER_API_KEY"] == plan.worker_key
        assert backend.api_key is not None
        assert backend.api_key.get_secret_value() == plan.worker_key
        # Never on a command line: /proc/<pid>/cmdline is readable by every local user.
        assert not any(plan.worker_key in arg for arg in worker.argv)
        assert not any(worker.env["KVTIER_WORKER_P2P_SECRET"] in arg for arg in worker.argv)
    assert plan.admin_key not in " ".join(plan.proxy.argv)
    other = build_plan(StackOptions(), tmp_path)
    assert {other.worker_key, other.admin_key}.isdisjoint({plan.worker_key, plan.admin_key})


@pytest.mark.usefixtures("open_umask")
def test_the_config_with_the_keys_is_owner_only(tmp_path: Path) -> None:
    plan = build_plan(StackOptions(), tmp_path)
    plan.config_path.write_text("left over from an earlier run\n")
    plan.config_path.chmod(0o644)
    write_proxy_config(plan)
    assert is_private(plan.config_path)
    assert oct(plan.config_path.stat().st_mode & 0o777) == "0o600"
    assert plan.worker_key in plan.config_path.read_text()
    assert is_private(admin_key_path(plan))
    assert admin_key_path(plan).read_text().strip() == plan.admin_key
    fresh = build_plan(StackOptions(), tmp_path / "new")
    fresh.config_path.parent.mkdir()
    write_proxy_config(fresh)
    assert is_private(fresh.config_path)


@pytest.mark.usefixtures("open_umask")
def test_a_planted_symlink_does_not_receive_the_secret(tmp_path: Path) -> None:
    """Another user who can write the run dir plants ``proxy.yaml -> /their/file``."""
    target = tmp_path / "attacker-readable"
    target.write_text("")
    link = tmp_path / "proxy.yaml"
    link.symlink_to(target)
    with pytest.raises(OSError):
        write_private_text(link, "admin_key: secret\n")
    assert target.read_text() == ""


def test_the_ready_banner_names_the_key_file_not_the_key(tmp_path: Path) -> None:
    """``pdproxy up``'s output often lands in a log file (CI, nohup): no secret in it."""
    plan = build_plan(StackOptions(), tmp_path)
    banner = ready_banner(plan.endpoint, plan.model_name, "logs", [], str(admin_key_path(plan)))
    assert plan.admin_key not in banner and plan.worker_key not in banner
    assert f"$(cat {admin_key_path(plan)})" in banner
