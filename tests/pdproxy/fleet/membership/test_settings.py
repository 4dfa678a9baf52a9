"""Membership settings refuse what cannot work, at start, naming the rule."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pdproxy.cli import run_server
from pdproxy.errors import ConfigError
from pdproxy.settings import ProxySettings, validation_error_text
from pdproxy.settings.membership import (
    DnsDiscoverySettings,
    DnsGroup,
    RegistrationSettings,
    nameserver_address,
)
from tests.pdproxy.fleet.membership.conftest import RegistrationKeys

GROUP: dict[str, Any] = {"name": "p", "query": "p.test", "port": 80, "role": "producer"}


@pytest.mark.parametrize(
    "change",
    [
        {"port": None},  # A records need a port
        {"record": "srv"},  # SRV records carry their own
        {"name": "bad name"},
        {"name": "x" * 25},
        {"dialect": "grpc"},
        {"kv_port": 0},
    ],
)
def test_bad_groups(change: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        DnsGroup.model_validate(GROUP | change)


def test_nameserver_forms() -> None:
    assert nameserver_address("10.0.0.1") == ("10.0.0.1", 53)
    assert nameserver_address("10.0.0.1:5353") == ("10.0.0.1", 5353)
    assert nameserver_address("[::1]:5353") == ("::1", 5353)
    for bad in ("dns.example:53", "10.0.0.1:0", "10.0.0.1:x"):
        with pytest.raises(ValueError):
            DnsDiscoverySettings(nameserver=bad)


def test_group_names_are_unique() -> None:
    with pytest.raises(ValidationError, match="unique"):
        DnsDiscoverySettings(groups=[GROUP, GROUP])


def test_registration_rules() -> None:
    with pytest.raises(ValidationError, match="curve"):
        RegistrationSettings(endpoint="tcp://0.0.0.0:30001")
    with pytest.raises(ValidationError):
        RegistrationSettings(endpoint="ipc:///tmp/x")
    with pytest.raises(ValidationError):
        RegistrationSettings(allowed_networks=["10.0.0.0/33"])


def test_errors_do_not_echo_the_api_key() -> None:
    with pytest.raises(ValidationError) as caught:
        ProxySettings(
            membership={"dns": {"groups": [GROUP | {"api_key": "sekrit-77", "port": "x"}]}}
        )
    assert "sekrit-77" not in validation_error_text(caught.value)


def test_registration_is_refused_with_a_worker_group(registration_keys: RegistrationKeys) -> None:
    """The registration socket binds in one process: a group of N would split the registrations."""
    registration = {
        "endpoint": "tcp://127.0.0.1:30001",
        "curve_secret_key_file": str(registration_keys.proxy_secret),
        "curve_clients_dir": str(registration_keys.clients_dir),
    }
    settings = ProxySettings.model_validate(
        {"workers": 2, "membership": {"registration": registration}}
    )
    with pytest.raises(ConfigError, match="workers: 1"):
        run_server(settings)


def test_a_dns_group_named_reg_is_refused_beside_registration(
    registration_keys: RegistrationKeys,
) -> None:
    """DNS owns its groups' namespaces (``<group>-...``): a group named ``reg`` would own every
    registered worker's generated name (``reg-<address>-<port>``)."""
    registration = {
        "endpoint": "tcp://127.0.0.1:30001",
        "curve_secret_key_file": str(registration_keys.proxy_secret),
        "curve_clients_dir": str(registration_keys.clients_dir),
    }
    dns = {"groups": [GROUP | {"name": "reg"}]}
    with pytest.raises(ValidationError, match="reg"):
        ProxySettings.model_validate({"membership": {"dns": dns, "registration": registration}})
    ProxySettings.model_validate({"membership": {"dns": dns}})  # no registration: fine
