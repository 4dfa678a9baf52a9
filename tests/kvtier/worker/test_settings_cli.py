"""Settings from flags, a YAML file and environment variables (flags win)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.worker.__main__ import parse_settings


def test_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    settings, level = parse_settings(
        [
            "--role",
            "producer",
            "--model",
            "sim",
            "--port",
            "8123",
            "--p2p-port",
            "5601",
            "--events-endpoint",
            "tcp://127.0.0.1:5557",
            "--log-level",
            "debug",
        ]
    )
    assert (settings.role, settings.model, settings.port, settings.p2p_port) == (
        "producer",
        "sim",
        8123,
        5601,
    )
    assert settings.events_endpoint == "tcp://127.0.0.1:5557" and level == "debug"
    assert settings.model_name == "kvtier-sim"


def test_config_file_env_and_flag_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "worker.yaml"
    config.write_text("role: consumer\nmodel: sim\nport: 9000\nnum_pages: 77\n")
    monkeypatch.setenv("KVTIER_WORKER_MAX_RUNNING", "5")
    monkeypatch.setenv("KVTIER_WORKER_PORT", "9999")
    settings, _ = parse_settings(["--config", str(config), "--port", "9100"])
    assert settings.role == "consumer" and settings.num_pages == 77
    assert settings.port == 9100  # flag over file over env
    assert settings.max_running == 5  # env where nothing else says


def test_unknown_config_keys_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "worker.yaml"
    config.write_text("rol: producer\n")
    with pytest.raises(ValueError, match="rol"):
        parse_settings(["--config", str(config)])


def test_bad_flag_values_exit() -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--role", "router"])
