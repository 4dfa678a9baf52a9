"""``pdproxy up --engine vllm --lora NAME``'s plan: an adapter made per name in the run directory,
loaded by every instance with ``--enable-lora``, listed on every backend and served by the proxy
as a model of its own. No vLLM needed (tests/vllm/lora runs the real thing)."""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import pytest

from pdproxy.settings import ProxySettings
from pdproxy.stack.cli import build_parser, options_from_args
from pdproxy.stack.plan import StackOptions, StackPlan
from pdproxy.stack.vllm_engine import LORA_MAX_RANK, SERVED_NAME
from pdproxy.stack.vllm_lora import make_adapter
from pdproxy.stack.vllm_model import TinyLlamaShape
from pdproxy.stack.vllm_plan import build_vllm_plan
from tests.stack.test_vllm_plan import _flag, _installed


def _plan(tmp_path: Path, *argv: str) -> tuple[Path, StackPlan]:
    paths = _installed(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = options_from_args(build_parser().parse_args(["--engine", "vllm", *argv]))
    ports = itertools.count(30000)
    return run_dir, build_vllm_plan(options, paths, run_dir, lambda: next(ports))


def test_every_instance_loads_the_adapters_and_the_proxy_routes_them(tmp_path: Path) -> None:
    run_dir, plan = _plan(tmp_path, "--lora", "sql", "--lora", f"chat@{SERVED_NAME}")
    for worker in plan.workers:
        argv = worker.argv
        assert "--enable-lora" in argv
        assert int(_flag(argv, "--max-lora-rank")) == LORA_MAX_RANK
        assert _flag(argv, "--max-loras") == "2"
        i = argv.index("--lora-modules")
        assert argv[i + 1 : i + 3] == (f"sql={run_dir / 'lora' / 'sql'}",
                                       f"chat={run_dir / 'lora' / 'chat'}")  # fmt: skip
    for name in ("sql", "chat"):
        config = json.loads((run_dir / "lora" / name / "adapter_config.json").read_text())
        assert config["r"] == LORA_MAX_RANK and config["peft_type"] == "LORA"
    settings = ProxySettings.model_validate(plan.proxy_config)
    assert all(b.models == (SERVED_NAME, "sql", "chat") for b in settings.backends)
    served = plan.proxy_config["models"]["served"]
    assert served == {SERVED_NAME: {}, "sql": {"base": SERVED_NAME}, "chat": {"base": SERVED_NAME}}
    assert plan.models == (SERVED_NAME, "sql", "chat")


def test_without_lora_nothing_changes(tmp_path: Path) -> None:
    _, plan = _plan(tmp_path)
    assert all("--enable-lora" not in w.argv for w in plan.workers)
    assert "models" not in plan.proxy_config
    assert all("models" not in b for b in plan.proxy_config["backends"])


@pytest.mark.parametrize(
    ("lora", "problem"),
    [
        ((("a", "other-model"),), "vLLM serves"),
        (((SERVED_NAME, SERVED_NAME),), "taken"),
        ((("../x", SERVED_NAME),), "taken or not"),
    ],
)
def test_bad_adapters_are_refused(
    tmp_path: Path, lora: tuple[tuple[str, str], ...], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        build_vllm_plan(StackOptions(lora=lora), _installed(tmp_path), tmp_path)


def test_models_still_need_the_reference_workers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--models"):
        build_vllm_plan(StackOptions(models=("a", "b")), _installed(tmp_path), tmp_path)


def test_the_adapter_is_made_from_its_name_and_seed(tmp_path: Path) -> None:
    def files(root: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(root.iterdir())}

    a = files(make_adapter(tmp_path / "a", "sql"))
    assert a == files(make_adapter(tmp_path / "b", "sql"))
    assert (
        a["adapter_model.safetensors"]
        != files(make_adapter(tmp_path / "c", "chat"))["adapter_model.safetensors"]
    )
    raw = a["adapter_model.safetensors"]
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    shape = TinyLlamaShape()
    # PEFT's names, which vLLM maps onto its packed qkv / gate_up projections.
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert header[f"{q}.lora_A.weight"]["shape"] == [LORA_MAX_RANK, shape.hidden]
    assert header[f"{q}.lora_B.weight"]["shape"] == [shape.hidden, LORA_MAX_RANK]
    assert len(header) - 1 == 2 * 7 * shape.layers  # A and B, 7 projections, every layer
