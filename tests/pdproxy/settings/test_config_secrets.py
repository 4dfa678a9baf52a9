"""Config errors never echo a secret: an attacker who reads logs or an admin API error learns
the rule that failed, not the key that was in the wrong place."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from pdproxy.app import create_app
from pdproxy.cli import main
from pdproxy.errors import ConfigError
from pdproxy.routing.kv.build import parse_settings
from pdproxy.settings import ProxySettings, validation_error_text

SECRET = "s3cret-" + uuid.uuid4().hex


def _bad_configs() -> list[dict[str, object]]:
    backend = {"name": "p0", "url": "http://127.0.0.1:9", "role": "producer"}
    return [
        {"backends": [{**backend, "api_key": SECRET, "bogus": 1}]},  # the dict is the input
        {"backends": [{**backend, "api_key": SECRET, "role": "nope"}]},
        {"backends": [{**backend, "url": f"htp://user:{SECRET}@host"}]},
        # http(s), but refused by the upstream client's URL check (user info): no echo there either
        {"backends": [{**backend, "url": f"http://user:{SECRET}@host:8000"}]},
        {"backends": [{**backend, "url": f"http://user:{SECRET}@host:8000/p#frag"}]},
        {"api_keys": [{"key": SECRET, "trusted": "maybe"}]},
        {"api_keys": [{"kee": SECRET}]},
        {"admin_kee": SECRET},
        {"admin_key": [SECRET]},
    ]


@pytest.mark.parametrize("config", _bad_configs())
def test_validation_error_text_names_the_field_not_the_value(config: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as caught:
        ProxySettings(**config)  # type: ignore[arg-type]
    text = validation_error_text(caught.value)
    assert text and SECRET not in text


def test_pydantic_alone_would_quote_the_key() -> None:
    """Why the text above exists: pydantic's own message quotes the input (a mistyped field
    name puts the key in front of everyone who reads the error)."""
    with pytest.raises(ValidationError) as caught:
        ProxySettings(admin_kee=SECRET)  # type: ignore[call-arg]
    assert SECRET in str(caught.value)


@pytest.mark.parametrize("config", _bad_configs())
def test_pdproxy_serve_prints_no_secret(
    config: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps(config))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and SECRET not in err


def test_a_yaml_syntax_error_does_not_quote_the_line(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(f'host: 127.0.0.1\nadmin_key: "{SECRET}\nport: [\n')
    with pytest.raises(ConfigError) as caught:
        ProxySettings(config_file=path)
    assert "line" in str(caught.value) and SECRET not in str(caught.value)


def test_router_options_error_hides_the_index_url_password() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"index_url": f"redis://:{SECRET}@h:6379/0", "block_size": "x"})
    assert SECRET not in str(caught.value)


def test_index_flag_error_hides_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--index", f"http://:{SECRET}@h/0"]) == 2
    assert SECRET not in capsys.readouterr().err


async def test_admin_api_error_does_not_echo_a_backend_key() -> None:
    admin = "admin-" + uuid.uuid4().hex
    app = create_app(ProxySettings(admin_key=admin))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            resp = await client.post(
                "/admin/backends",
                headers={"authorization": f"Bearer {admin}"},
                json={"name": "p9", "url": "http://127.0.0.1:9", "role": "producer",
                      "api_key": SECRET, "surprise": True},
            )  # fmt: skip
    assert resp.status_code == 400
    assert SECRET not in resp.text and "surprise" in resp.text
