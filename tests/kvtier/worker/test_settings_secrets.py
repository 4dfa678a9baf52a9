"""Worker settings keep keys out of reprs, errors and the process's exit message."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.worker.__main__ import main, parse_settings
from kvtier.worker.settings import WorkerSettings, settings_error_text

SECRET = "s3cret-" + uuid.uuid4().hex


def test_keys_are_secret_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_WORKER_API_KEY", SECRET)
    monkeypatch.setenv("KVTIER_P2P_SECRET", SECRET + "p2p")
    settings = WorkerSettings()
    assert settings.api_key is not None and settings.api_key.get_secret_value() == SECRET
    assert settings.p2p_secret.get_secret_value() == SECRET + "p2p"
    assert SECRET not in repr(settings) and SECRET not in str(settings.model_dump())


@pytest.mark.parametrize(
    "yaml_text",
    [
        f"api_kee: {SECRET}\n",  # a mistyped field name
        f"api_key: [{SECRET}]\n",  # the wrong type
        f"p2p_secret: {{value: {SECRET}}}\n",
    ],
)
def test_a_bad_config_names_the_field_not_the_value(
    yaml_text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "worker.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ValidationError) as caught:
        parse_settings(["--config", str(config)])
    text = settings_error_text(caught.value)
    assert text and SECRET not in text
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config)])
    message = str(exited.value.code)
    assert "invalid settings" in message and SECRET not in message


def test_a_yaml_syntax_error_does_not_quote_the_line(tmp_path: Path) -> None:
    config = tmp_path / "worker.yaml"
    config.write_text(f'role: producer\napi_key: "{SECRET}\nport: [\n')
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(config)])
    message = str(exited.value.code)
    assert "line" in message and SECRET not in message


@pytest.mark.parametrize("field", ["p2p_secret", "api_key"])
@pytest.mark.parametrize("value", ["change-me", "CHANGEME", " password "])
def test_placeholder_secrets_are_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError, match="placeholder") as caught:
        WorkerSettings(**{field: value})
    assert value.strip().lower() not in settings_error_text(caught.value).lower()
