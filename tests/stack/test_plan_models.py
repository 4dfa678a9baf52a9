"""``pdproxy up --models a,b``: every model gets its own workers, the proxy config names each
backend's models and adapters, and the worker CLI and proxy settings accept what is planned."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvtier.worker.__main__ import parse_settings
from pdproxy.settings import ProxySettings
from pdproxy.stack.cli import build_parser as build_up_parser
from pdproxy.stack.cli import options_from_args
from pdproxy.stack.plan import StackOptions, WorkerModel, build_plan


def test_two_models_and_an_adapter_are_planned(tmp_path: Path) -> None:
    args = build_up_parser().parse_args(
        ["--model", "sim", "--models", "alpha,beta", "--lora", "alpha-style", "--lora", "b2@beta"]
    )
    options = options_from_args(args)
    assert options.models == ("alpha", "beta")
    assert options.lora == (("alpha-style", "alpha"), ("b2", "beta"))
    ports = itertools.count(21000)
    plan = build_plan(options, tmp_path, lambda: next(ports))
    assert [w.name for w in plan.workers] == ["alpha-p0", "alpha-c0", "beta-p0", "beta-c0"]
    assert plan.models == ("alpha", "beta", "alpha-style", "b2")
    served = {}
    for worker in plan.workers:
        settings, _ = parse_settings(list(worker.argv[3:]))
        served[worker.name] = (settings.model_name, tuple(settings.lora_modules))
    assert served == {
        "alpha-p0": ("alpha", ("alpha-style",)), "alpha-c0": ("alpha", ("alpha-style",)),
        "beta-p0": ("beta", ("b2",)), "beta-c0": ("beta", ("b2",)),
    }  # fmt: skip
    proxy = ProxySettings(**plan.proxy_config)
    assert {b.name: b.models for b in proxy.backends} == {
        "alpha-p0": ("alpha", "alpha-style"), "alpha-c0": ("alpha", "alpha-style"),
        "beta-p0": ("beta", "b2"), "beta-c0": ("beta", "b2"),
    }  # fmt: skip
    assert proxy.models.served["alpha-style"].base == "alpha"
    assert set(proxy.models.served) == {"alpha", "beta", "alpha-style", "b2"}


def test_one_model_plans_as_before(tmp_path: Path) -> None:
    ports = itertools.count(22000)
    plan = build_plan(StackOptions(model=WorkerModel.SIM), tmp_path, lambda: next(ports))
    assert "models" not in plan.proxy_config
    assert all("models" not in b for b in plan.proxy_config["backends"])
    assert plan.models == ("kvtier-sim",)


@pytest.mark.parametrize(
    ("models", "lora", "message"),
    [
        (("a", "a"), (), "twice"),
        (("a",), (("x", "b"),), "no model 'b'"),
        (("a", "x"), (("x", "a"),), "a model's name"),
    ],
)
def test_bad_model_plans_are_refused(
    tmp_path: Path, models: tuple[str, ...], lora: tuple[tuple[str, str], ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_plan(StackOptions(models=models, lora=lora), tmp_path, lambda: 23000)
